"""Measured per-operator efficiency curves: the fraction of the roofline a kernel reaches, by the shape that moves it.

`op_efficiency.json` beside this file is a small table derived by `benchmarks/planner_op_efficiency.py` from
AIConfigurator's public per-kernel measurements (Apache-2.0; the file names its commit and tables): GEMM by tokens and
dtype, grouped GEMM (MoE) by routed tokens per expert and dtype, MLA and GQA attention prefill by prompt length and
decode by query heads, batch and cached tokens per sequence (a `Grid`; MLA decode over an FP8 cache has its own grid,
from TensorRT-LLM's FP8-cache kernel, against the FP8 math peak), all-reduce by message bytes and group size.
Hopper curves were measured on H200 and serve H100/H800/H200; Blackwell curves on B200 and serve B200/GB200/B300/GB300.
An accelerator with no curves (AMD, a user row) gets None and the planner falls back to the flat `Efficiency` factors.

A component's time is its roofline time divided by the curve's value at its shape; between measured points the value is
interpolated linearly in log(shape), and outside them it is held at the nearest end (never extrapolated).
"""

from __future__ import annotations

import bisect
import functools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

OP_EFFICIENCY_PATH = Path(__file__).with_name("op_efficiency.json")
FLOOR = 1e-6  # a measured efficiency is never below this; it keeps a division finite


@dataclass(frozen=True)
class Curve:
    """Points (shape, efficiency) sorted by shape; `at` interpolates in log(shape)."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]

    @classmethod
    def of(cls, points: Sequence[Sequence[float]], name: str) -> Curve:
        if not points:
            raise ValueError(f"op_efficiency.json: curve {name} has no points")
        pts = sorted((float(x), float(y)) for x, y in points)
        if any(x <= 0 or not 0 < y <= 1.5 for x, y in pts):
            raise ValueError(f"op_efficiency.json: curve {name} needs shapes > 0 and efficiencies in (0, 1.5], got {pts}")
        return cls(tuple(x for x, _ in pts), tuple(y for _, y in pts))

    def at(self, x: float) -> float:
        return _between(self.xs, self.ys, x)


@dataclass(frozen=True)
class Grid:
    """Decode attention: for each measured query-head count, curves by cached tokens per sequence at each measured batch.
    `at` takes the measured head count nearest in log, then interpolates log-linearly between the two measured batches
    around the call's (holding the ends), each curve read at the call's cached tokens per sequence."""

    heads: tuple[int, ...]
    batches: tuple[tuple[float, ...], ...]  # per head count, sorted
    curves: tuple[tuple[Curve, ...], ...]  # per head count, one per batch

    @classmethod
    def of(cls, raw: Mapping[str, Mapping[str, Sequence[Sequence[float]]]], name: str) -> Grid:
        if not raw or any(not by_batch for by_batch in raw.values()):
            raise ValueError(f"op_efficiency.json: grid {name} needs head counts, each with batches")
        heads = tuple(sorted(int(h) for h in raw))
        batches = tuple(tuple(sorted(float(b) for b in raw[str(h)])) for h in heads)
        curves = tuple(tuple(Curve.of(raw[str(h)][_key(raw[str(h)], b)], f"{name}.{h}.{b:g}") for b in bs) for h, bs in zip(heads, batches, strict=True))
        return cls(heads, batches, curves)

    def at(self, heads: float, batch: float, tokens_per_seq: float) -> float:
        i = min(range(len(self.heads)), key=lambda j: abs(math.log(self.heads[j]) - math.log(max(heads, 1.0))))
        return _between(self.batches[i], [c.at(max(tokens_per_seq, 1.0)) for c in self.curves[i]], max(batch, 1.0))


def _key(by_batch: Mapping[str, object], batch: float) -> str:
    return next(k for k in by_batch if float(k) == batch)


def _between(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Log-linear in x between the points around it, the end values outside."""
    if x <= xs[0]:
        return max(ys[0], FLOOR)
    if x >= xs[-1]:
        return max(ys[-1], FLOOR)
    i = bisect.bisect_right(xs, x)
    w = (math.log(x) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
    return max(ys[i - 1] + w * (ys[i] - ys[i - 1]), FLOOR)


_WIDER = {"fp4": ("fp4", "fp8", "bf16"), "fp8": ("fp8", "bf16"), "bf16": ("bf16",)}


def _by_dtype(curves: Mapping[str, Curve], dtype: str, op: str) -> Curve:
    """The curve of the precision the kernel runs at, or the next wider one measured (as `Accelerator.flops` falls back)."""
    for d in _WIDER.get(dtype, (dtype,)):
        if d in curves:
            return curves[d]
    raise ValueError(f"no {op} curve for dtype={dtype!r}: measured {sorted(curves)}")


@dataclass(frozen=True)
class OpCurves:
    family: str
    measured_on: str
    gemm_curves: Mapping[str, Curve]
    moe_curves: Mapping[str, Curve]
    prefill_attention: Curve
    decode_attention: Grid
    allreduce_curves: Mapping[int, Curve]
    gqa_prefill_attention: Curve | None = None  # None: not measured (or not physical) for this family; flat factors
    gqa_decode_attention: Grid | None = None
    decode_attention_fp8_cache: Grid | None = None  # MLA decode over an FP8 cache, its roofline's math at the FP8 peak

    def gemm(self, dtype: str, tokens: float) -> float:
        return _by_dtype(self.gemm_curves, dtype, "gemm").at(max(tokens, 1.0))

    def moe(self, dtype: str, tokens_per_expert: float) -> float:
        return _by_dtype(self.moe_curves, dtype, "moe").at(max(tokens_per_expert, 1e-3))

    def attention_prefill(self, prompt_tokens: float, mla: bool = True) -> float | None:
        """None: no curve for this attention kind (the flat factor prices it)."""
        curve = self.prefill_attention if mla else self.gqa_prefill_attention
        return None if curve is None else curve.at(max(prompt_tokens, 1.0))

    def attention_decode(self, heads: float, batch: float, tokens_per_seq: float, mla: bool = True, fp8_cache: bool = False) -> float | None:
        """A decode attention call over `batch` sequences of `tokens_per_seq` cached tokens, `heads` query heads per rank.
        `fp8_cache` (MLA): the FP8-cache kernel's grid, whose roofline counts the math at the FP8 peak (`fp8_cache_grid`)."""
        if mla and fp8_cache and self.decode_attention_fp8_cache is not None:
            return self.decode_attention_fp8_cache.at(heads, batch, tokens_per_seq)
        grid = self.decode_attention if mla else self.gqa_decode_attention
        return None if grid is None else grid.at(heads, batch, tokens_per_seq)

    @property
    def fp8_cache_grid(self) -> bool:
        """Whether MLA decode over an FP8 cache has its own measured grid (then priced at the FP8 math peak)."""
        return self.decode_attention_fp8_cache is not None

    def allreduce(self, group: int, nbytes: float) -> float:
        """The measured group size nearest below `group` (the largest measured one past it)."""
        sizes = sorted(self.allreduce_curves)
        size = max((s for s in sizes if s <= group), default=sizes[0])
        return self.allreduce_curves[size].at(max(nbytes, 1.0))


def _family(name: str, raw: Mapping) -> OpCurves:
    def many(key: str) -> dict[str, Curve]:
        return {d: Curve.of(p, f"{name}.{key}.{d}") for d, p in raw[key].items()}

    return OpCurves(
        family=name,
        measured_on=raw["measured_on"],
        gemm_curves=many("gemm"),
        moe_curves=many("moe"),
        prefill_attention=Curve.of(raw["attention_prefill"], f"{name}.attention_prefill"),
        decode_attention=Grid.of(raw["attention_decode"], f"{name}.attention_decode"),
        allreduce_curves={int(g): Curve.of(p, f"{name}.allreduce.{g}") for g, p in raw["allreduce"].items()},
        gqa_prefill_attention=Curve.of(raw["gqa_attention_prefill"], f"{name}.gqa_attention_prefill") if "gqa_attention_prefill" in raw else None,
        gqa_decode_attention=Grid.of(raw["gqa_attention_decode"], f"{name}.gqa_attention_decode") if "gqa_attention_decode" in raw else None,
        decode_attention_fp8_cache=(
            Grid.of(raw["attention_decode_fp8_cache"], f"{name}.attention_decode_fp8_cache") if "attention_decode_fp8_cache" in raw else None
        ),
    )


@functools.lru_cache(maxsize=4)
def load_op_curves(path: Path = OP_EFFICIENCY_PATH) -> dict[str, OpCurves]:
    """accelerator name -> its family's curves, from the shipped (or a given) table."""
    raw = json.loads(path.read_text())
    out: dict[str, OpCurves] = {}
    for name, fam in raw["families"].items():
        curves = _family(name, fam)
        for acc in fam["used_for"]:
            out[acc] = curves
    return out


def curves_for(accelerator: str) -> OpCurves | None:
    return load_op_curves().get(accelerator)


def origin() -> str:
    raw = json.loads(OP_EFFICIENCY_PATH.read_text())
    return f"{raw['origin']}; {raw['licence']}"

"""Number formats for mixed quantisation: what one stored value costs, and which GEMM precision runs it.

Block-scaled formats pay their scales per value: MXFP4 (OCP MX) is 4-bit E2M1 plus one E8M0 byte per 32 values = 4.25
bits; NVFP4 is E2M1 plus one FP8 (E4M3) scale per 16 values = 4.5 bits, plus one fp32 scale per tensor (4 bytes, counted
per routed-expert tensor, where the planner knows how many tensors there are). FP8 weights as DeepSeek-V3 and Kimi K2
ship them carry one fp32 scale per 128 x 128 block (8 + 32/16384 bits: 0.02%, ignored as in the `fp8` preset). `fp4` is MXFP4 by another name (the OCP FP4 the
release uses); the raw 4-bit floor without scales is not a format anyone stores.

`--expert-dtype`, `--trunk-dtype`, `--kv-dtype` and `--state-dtype` replace fields of a base `Quantisation` (a named
preset, or the checkpoint's own `quantization_config`); the GEMM precision follows the weight format unless the
preset already chose one for that format (MXFP4 experts run as W4A8, K3's release; NVFP4 is built for W4A4).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from openk3.planner.inputs import Quantisation


@dataclass(frozen=True)
class WeightFormat:
    bits: float  # per value, block scales included
    tensor_scale_bytes: float  # per tensor (NVFP4's fp32 global scale)
    compute: str  # GEMM precision the format runs at by default


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    "mxfp4": WeightFormat(4 + 8 / 32, 0.0, "fp8"),
    "fp4": WeightFormat(4 + 8 / 32, 0.0, "fp8"),
    "nvfp4": WeightFormat(4 + 8 / 16, 4.0, "fp4"),
    "fp8": WeightFormat(8.0, 0.0, "fp8"),
    "bf16": WeightFormat(16.0, 0.0, "bf16"),
}
CACHE_BYTES = {"fp8": 1, "bf16": 2, "fp32": 4}  # KV cache / MLA latent / conv windows (per-tensor scales, negligible)
STATE_BYTES = {"bf16": 2, "fp32": 4}  # KDA recurrent state: accumulates over the whole sequence, fp32 unless told


def _pick(table: Mapping[str, object], flag: str, name: str) -> None:
    if name not in table:
        raise ValueError(f"{flag}={name!r} is invalid: expected one of {sorted(table)}")


def with_dtypes(
    base: Quantisation,
    expert: str | None = None,
    trunk: str | None = None,
    kv: str | None = None,
    state: str | None = None,
) -> Quantisation:
    """`base` with the named formats swapped in; None keeps the base's choice."""
    changes: dict[str, object] = {}
    if expert is not None:
        _pick(WEIGHT_FORMATS, "--expert-dtype", expert)
        f = WEIGHT_FORMATS[expert]
        changes |= {"expert_bits": f.bits, "expert_tensor_scale_bytes": f.tensor_scale_bytes, "expert_compute": f.compute, "expert_format": expert}
    if trunk is not None:
        _pick(WEIGHT_FORMATS, "--trunk-dtype", trunk)
        f = WEIGHT_FORMATS[trunk]
        changes |= {"trunk_bits": f.bits, "trunk_compute": f.compute, "trunk_format": trunk}
    if kv is not None:
        _pick(CACHE_BYTES, "--kv-dtype", kv)
        changes["cache_dtype_bytes"] = CACHE_BYTES[kv]
    if state is not None:
        _pick(STATE_BYTES, "--state-dtype", state)
        changes["state_dtype_bytes"] = STATE_BYTES[state]
    return replace(base, **changes)  # type: ignore[arg-type]


def describe(q: Quantisation) -> str:
    kv = {v: k for k, v in CACHE_BYTES.items()}[q.cache_dtype_bytes]
    state = {v: k for k, v in STATE_BYTES.items()}.get(q.state_dtype_bytes, f"{q.state_dtype_bytes} B")
    return (
        f"experts {q.expert_format} ({q.expert_bits:g} bit, {q.expert_compute} GEMM), trunk {q.trunk_format} ({q.trunk_bits:g} bit, "
        f"{q.trunk_compute}), KV/latent {kv}, KDA state {state}"
    )

"""Implementations chosen by name: one registry keyed by (op, implementation, device), instead of a table per op.

Each op has a reference implementation "naive" (its definition, differentiable) and faster ones; "auto" is not an
implementation but a rule, resolved once for a target -- the device, the dtype and whether autograd will run -- when the
model is built or prepared for serving (K3ForCausalLM.select_ops), never per call inside a forward. An entry registered
for a device ("cpu", "cuda") is preferred there over the same name registered for any device, so a backend (C kernels on
CPU, Triton or fla on CUDA) plugs in as an entry of its own.

Per-call size policies that are part of an implementation (moe "sized": single-token / batched / grouped by the step's
pairs; AttnRes "sized": one-shot below 64 tokens) keep their switches in ops/thresholds.py with the measurements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ANY_DEVICE = "any"


@dataclass(frozen=True)
class OpTarget:
    """What "auto" is resolved for."""

    device: str = "cpu"  # a device type: "cpu", "cuda", ...
    training: bool = False  # autograd runs through the op: only differentiable implementations qualify


@dataclass(frozen=True)
class Implementation:
    fn: Callable[..., Any] | None  # None: evaluated by the model itself, which reads the resolved name (AttnRes)
    differentiable: bool
    summary: str


CPU_INFERENCE = OpTarget()  # what a model is built for until a trainer or the serving runner selects again

AutoRule = Callable[[OpTarget], str]


class OpRegistry:
    def __init__(self) -> None:
        self._impls: dict[tuple[str, str, str], Implementation] = {}
        self._auto: dict[str, AutoRule] = {}

    def register(self, op: str, impl: str, fn: Callable[..., Any] | None, summary: str, device: str = ANY_DEVICE, differentiable: bool = False) -> None:
        key = (op, impl, device)
        if key in self._impls:
            raise ValueError(f"OpRegistry: {op}/{impl} is already registered for device {device!r}")
        if impl == "auto":
            raise ValueError(f"OpRegistry: 'auto' is a rule (register_auto), not an implementation of {op}")
        self._impls[key] = Implementation(fn, differentiable, summary)

    def register_auto(self, op: str, rule: AutoRule) -> None:
        self._auto[op] = rule

    def names(self, op: str) -> list[str]:
        """The implementation names of `op` (any device), and "auto" when it has a rule."""
        names = sorted({impl for o, impl, _ in self._impls if o == op})
        if not names:
            raise ValueError(f"unknown op {op!r}: registered ops are {sorted({o for o, _, _ in self._impls})}")
        return names + (["auto"] if op in self._auto else [])

    def entry(self, op: str, impl: str, target: OpTarget = CPU_INFERENCE) -> tuple[str, Implementation]:
        """(the implementation's name, its entry) for `impl` on `target`: "auto" resolved by the op's rule, a device's own
        entry before the any-device one; refuses a non-differentiable implementation for training."""
        names = self.names(op)
        if impl not in names:
            raise ValueError(f"{op}: implementation {impl!r} is unknown: expected one of {names}")
        name = self._auto[op](target) if impl == "auto" else impl
        found = self._impls.get((op, name, target.device)) or self._impls.get((op, name, ANY_DEVICE))
        if found is None:
            raise ValueError(f"{op}: implementation {name!r} is not available on {target.device!r}")
        if target.training and not found.differentiable:
            differentiable = sorted({i for (o, i, _), e in self._impls.items() if o == op and e.differentiable})
            raise ValueError(f"{op}: implementation {name!r} is inference-only; for training choose one of {differentiable}")
        return name, found

    def get(self, op: str, impl: str, target: OpTarget = CPU_INFERENCE) -> Callable[..., Any]:
        name, found = self.entry(op, impl, target)
        if found.fn is None:
            raise ValueError(f"{op}/{name} has no function: the model evaluates it and reads the resolved name (entry())")
        return found.fn


@functools.cache
def registry() -> OpRegistry:
    """The built-in implementations (made once per process, on first use: importing the ops here keeps ops/ acyclic)."""
    from openk3.ops.kda.chunk import kda_chunk
    from openk3.ops.kda.chunk_autograd import kda_chunk_autograd
    from openk3.ops.kda.naive import kda_recurrent
    from openk3.ops.mla.absorbed import mla_absorbed
    from openk3.ops.mla.naive import mla_expanded
    from openk3.ops.mla.sdpa import mla_expanded_sdpa
    from openk3.ops.moe import moe_experts_auto
    from openk3.ops.moe.batched import moe_experts_batched
    from openk3.ops.moe.grouped import moe_experts_grouped
    from openk3.ops.moe.naive import moe_experts_naive
    from openk3.ops.short_conv import fast as conv_fast
    from openk3.ops.short_conv import naive as conv_naive

    r = OpRegistry()
    r.register("kda_prefill", "naive", kda_recurrent, "the per-token recurrence (the definition)", differentiable=True)
    r.register("kda_prefill", "fast", kda_chunk, "chunkwise WY form, buffers updated in place (inference)")
    r.register("kda_prefill", "autograd", kda_chunk_autograd, "chunkwise WY form without in-place updates (training)", differentiable=True)
    r.register_auto("kda_prefill", lambda t: "autograd" if t.training else "fast")

    r.register("short_conv", "naive", conv_naive.causal_conv1d, "per-sequence loops (the definition)", differentiable=True)
    r.register("short_conv", "fast", conv_fast.causal_conv1d, "one grouped conv over the packed batch", differentiable=True)
    r.register_auto("short_conv", lambda t: "fast")

    r.register("mla_prefill", "naive", mla_expanded, "K/V expanded, explicit softmax (the definition)", differentiable=True)
    r.register("mla_prefill", "fast", mla_expanded_sdpa, "K/V expanded, torch's SDPA", differentiable=True)
    r.register("mla_prefill", "absorbed", mla_absorbed, "attention in the latent space (the decode form)", differentiable=True)
    r.register_auto("mla_prefill", lambda t: "fast")

    r.register("moe_experts", "naive", moe_experts_naive, "per-token, per-expert loop (the definition)", differentiable=True)
    r.register("moe_experts", "fast", moe_experts_grouped, "tokens grouped per expert", differentiable=True)
    r.register("moe_experts", "batched", moe_experts_batched, "all experts as one padded batch (dense banks)", differentiable=True)
    r.register("moe_experts", "sized", moe_experts_auto, "single-token / batched / grouped by the step's pairs (ops/thresholds.py)", differentiable=True)
    r.register_auto("moe_experts", lambda t: "sized")

    # AttnRes is evaluated by the model itself (model/attn_res.py); the registry holds its names and its rule
    for name, summary in (("naive", "one-shot mix per sublayer"), ("fast", "two-phase, phase 1 once per block"), ("sized", "one-shot below 64 tokens")):
        r.register("attn_res", name, None, summary, differentiable=True)
    r.register_auto("attn_res", lambda t: "sized")
    return r


def op(name: str, impl: str, target: OpTarget = CPU_INFERENCE) -> Callable[..., Any]:
    """The function of `name` implemented as `impl` (or "auto") for `target`."""
    return registry().get(name, impl, target)

"""Implementations chosen by name: one registry keyed by (op, implementation, backend), instead of a table per op.

Each op has a reference implementation "naive" (its definition, differentiable) and faster ones; "auto" is not an
implementation but a rule, resolved once for a target -- the device, the dtype and whether autograd will run -- when the
model is built or prepared for serving (K3ForCausalLM.select_ops), never per call inside a forward.

A backend is where an entry runs. The same name may be registered for several; a target takes the first it offers
(OpTarget.backends), so a faster backend plugs in as entries of its own and no op asks "is my kernel there?" per call:
- "c": the C kernels of ops/cpu (CPU, fp32, inference), offered only where every one of them builds and loads;
- "cpu": torch's CPU-only forms (oneDNN's blocked weights, weight-first products; CPU, fp32, inference);
- a device type ("cuda", ...): that device's kernels (Triton, fla), offered on that device;
- "any": plain torch ops, on every device and dtype, the only backend training gets on CPU.
An entry of an inference backend refuses a call outside what it was chosen for (autograd on, another dtype or device,
ops/cpu/__init__.py) with an error that says to select again; it never falls back quietly.

Per-call size policies that are part of an implementation (moe "sized": single-token / batched / grouped by the step's
pairs; linear: C rows kernel / weight-first / oneDNN by rows and weight size; AttnRes "sized": one-shot below 64 tokens)
keep their switches in ops/thresholds.py with the measurements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ANY = "any"


@dataclass(frozen=True)
class OpTarget:
    """What "auto" is resolved for."""

    device: str = "cpu"  # a device type: "cpu", "cuda", ...
    training: bool = False  # autograd runs through the op: only differentiable implementations qualify
    dtype: torch.dtype = torch.float32  # the model's parameter dtype
    c_kernels: bool = True  # offer the "c" backend where it builds (False: the torch CPU forms, e.g. to compare against them)

    def backends(self) -> tuple[str, ...]:
        """The backends this target offers, best first (module docstring)."""
        from openk3.ops.cpu.build import kernels_available  # here, so that a target off the CPU never builds them

        if self.device != "cpu":
            return (self.device, ANY)
        if self.training or self.dtype != torch.float32:
            return (ANY,)
        return ("c", "cpu", ANY) if self.c_kernels and kernels_available() else ("cpu", ANY)


@dataclass(frozen=True)
class Implementation:
    fn: Callable[..., Any] | None  # None: evaluated by the model itself, which reads the resolved name and backend
    differentiable: bool
    summary: str
    backend: str = ANY
    requires: tuple[str, ...] = ()  # modules an optional dependency provides (imported on first call, checked by engines at start-up)


CPU_INFERENCE = OpTarget()  # what a model is built for until a trainer or the serving runner selects again

AutoRule = Callable[[OpTarget], str]  # the implementation's name for a target


class OpRegistry:
    def __init__(self) -> None:
        self._impls: dict[tuple[str, str, str], Implementation] = {}
        self._auto: dict[str, AutoRule] = {}

    def register(
        self,
        op: str,
        impl: str,
        fn: Callable[..., Any] | None,
        summary: str,
        backend: str = ANY,
        differentiable: bool = False,
        requires: tuple[str, ...] = (),
    ) -> None:
        key = (op, impl, backend)
        if key in self._impls:
            raise ValueError(f"OpRegistry: {op}/{impl} is already registered for backend {backend!r}")
        if impl == "auto":
            raise ValueError(f"OpRegistry: 'auto' is a rule (register_auto), not an implementation of {op}")
        self._impls[key] = Implementation(fn, differentiable, summary, backend, requires)

    def register_auto(self, op: str, rule: AutoRule) -> None:
        self._auto[op] = rule

    def names(self, op: str) -> list[str]:
        """The implementation names of `op` (on any backend), and "auto" when it has a rule."""
        names = sorted({impl for o, impl, _ in self._impls if o == op})
        if not names:
            raise ValueError(f"unknown op {op!r}: registered ops are {sorted({o for o, _, _ in self._impls})}")
        return names + (["auto"] if op in self._auto else [])

    def entry(self, op: str, impl: str, target: OpTarget = CPU_INFERENCE) -> tuple[str, Implementation]:
        """(the implementation's name, its entry) for `impl` on `target`: "auto" resolved by the op's rule, the entry of the
        first backend the target offers; refuses a non-differentiable implementation for training."""
        names = self.names(op)
        if impl not in names:
            raise ValueError(f"{op}: implementation {impl!r} is unknown: expected one of {names}")
        name = self._auto[op](target) if impl == "auto" else impl
        backends = target.backends()
        found = next((e for b in backends if (e := self._impls.get((op, name, b))) is not None), None)
        if found is None:
            raise ValueError(f"{op}: implementation {name!r} is not available on {target} (backends {list(backends)})")
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
    from openk3.ops.kda.fla_kernels import kda_chunk_fla, kda_recurrent_fla
    from openk3.ops.kda.naive import kda_recurrent
    from openk3.ops.linear import linear_c, linear_cpu, linear_torch
    from openk3.ops.mla.absorbed import mla_absorbed, mla_decode_paged
    from openk3.ops.mla.blockwise import mla_blockwise
    from openk3.ops.mla.decode_cpu import latent_attention_c
    from openk3.ops.mla.naive import mla_expanded
    from openk3.ops.mla.sdpa import mla_expanded_sdpa
    from openk3.ops.moe import moe_experts_sized
    from openk3.ops.moe.batched import moe_experts_batched
    from openk3.ops.moe.cpu_pairs import moe_experts_batched_c
    from openk3.ops.moe.grouped import moe_experts_grouped
    from openk3.ops.moe.naive import moe_experts_naive
    from openk3.ops.moe.router import sigmoid_topk_route, sigmoid_topk_route_c
    from openk3.ops.moe.static import moe_experts_static
    from openk3.ops.norm import rms_norm, rms_norm_c, rms_norm_reference
    from openk3.ops.short_conv import fast as conv_fast
    from openk3.ops.short_conv import naive as conv_naive
    from openk3.ops.triton import latent_attention_triton, mla_prefill_triton, moe_experts_triton

    partial = functools.partial
    FLA, TRITON = ("fla.ops.kda",), ("triton",)  # the gpu extra's packages (fla-core, triton), imported by their entries on first call
    r = OpRegistry()
    r.register("linear", "naive", linear_torch, "F.linear (the definition)", differentiable=True)
    r.register("linear", "fast", linear_cpu, "weight-first / oneDNN (packed weights) by rows and weight size", backend="cpu")
    r.register("linear", "fast", linear_c, "the C few-row kernel up to 16 rows, then the CPU forms", backend="c")
    r.register_auto("linear", lambda t: "fast" if "cpu" in t.backends() else "naive")

    r.register("rms_norm", "naive", rms_norm_reference, "spelled out (the definition)", differentiable=True)
    r.register("rms_norm", "fast", rms_norm, "torch's fused rms_norm in fp32", differentiable=True)
    r.register("rms_norm", "fast", rms_norm_c, "one C loop over the rows", backend="c")
    r.register_auto("rms_norm", lambda t: "fast")

    r.register("kda_prefill", "naive", kda_recurrent, "the per-token recurrence (the definition)", differentiable=True)
    r.register("kda_prefill", "fast", kda_chunk, "chunkwise WY form, buffers updated in place (inference)")
    r.register("kda_prefill", "autograd", kda_chunk_autograd, "chunkwise WY form without in-place updates (training)", differentiable=True)
    # fla's kernels (ops/kda/fla_kernels.py, fla imported on first call): chosen by name, like the Triton entries below
    r.register("kda_prefill", "fla", kda_chunk_fla, "fla's chunk_kda, states converted at the seam", backend="cuda", requires=FLA)
    r.register("kda_prefill", "fla_recurrent", kda_recurrent_fla, "fla's fused_recurrent_kda (decode-sized steps)", backend="cuda", requires=FLA)
    r.register_auto("kda_prefill", lambda t: "autograd" if t.training else "fast")

    r.register("short_conv", "naive", conv_naive.causal_conv1d, "per-sequence loops (the definition)", differentiable=True)
    r.register("short_conv", "fast", conv_fast.causal_conv1d, "one grouped conv over the packed batch", differentiable=True)
    r.register_auto("short_conv", lambda t: "fast")

    r.register("mla_prefill", "naive", mla_expanded, "K/V expanded, explicit softmax (the definition)", differentiable=True)
    r.register("mla_prefill", "fast", mla_expanded_sdpa, "K/V expanded, torch's SDPA", differentiable=True)
    r.register("mla_prefill", "absorbed", mla_absorbed, "attention in the latent space (the decode form)", differentiable=True)
    r.register("mla_prefill", "blockwise", mla_blockwise, "K/V expanded one key block at a time, online softmax", differentiable=True)
    # by name only, like the other Triton entries below ("auto" stays on the torch forms until a hardware run)
    r.register("mla_prefill", "triton", mla_prefill_triton, "the chunk's latent attention as a causal Triton kernel, no K/V", backend="cuda", requires=TRITON)
    r.register_auto("mla_prefill", lambda t: "fast")

    r.register("mla_decode", "naive", mla_decode_paged, "absorbed query over the gathered pages, torch ops", differentiable=True)
    r.register("mla_decode", "fast", partial(mla_decode_paged, latent_attention=latent_attention_c), "the latent attention in one C call", backend="c")
    # Triton (ops/triton/, imported on first call): chosen by name; "auto" keeps the torch forms on CUDA until docs/gpu.md's
    # hardware run has passed
    triton_decode = partial(mla_decode_paged, latent_attention=latent_attention_triton)
    r.register("mla_decode", "triton", triton_decode, "the latent attention as a paged Triton kernel", backend="cuda", requires=TRITON)
    r.register_auto("mla_decode", lambda t: "fast" if "c" in t.backends() else "naive")

    # the layer evaluates the decode token itself (model/kda.py) and reads the resolved name and backend
    r.register("kda_decode", "naive", None, "conv and delta rule on gathered slots: old state in, new state out", differentiable=True)
    r.register("kda_decode", "fast", None, "conv windows and states advanced in place in the pools, torch ops")
    r.register("kda_decode", "fast", None, "the whole token after the projections in one C call", backend="c")
    r.register_auto("kda_decode", lambda t: "naive" if t.training else "fast")

    r.register("moe_route", "naive", sigmoid_topk_route, "sigmoid, biased top-k, renormalise in torch ops", differentiable=True)
    r.register("moe_route", "fast", sigmoid_topk_route_c, "the steps after the logits in one C loop", backend="c")
    r.register_auto("moe_route", lambda t: "fast" if "c" in t.backends() else "naive")

    r.register("moe_experts", "naive", moe_experts_naive, "per-token, per-expert loop (the definition)", differentiable=True)
    r.register("moe_experts", "batched", moe_experts_batched, "all experts as one padded batch (dense banks)", differentiable=True)
    r.register("moe_experts", "batched", moe_experts_batched_c, "the pair bookkeeping and the expert MLPs in C", backend="c")
    for backend, linear in ((ANY, linear_torch), ("cpu", linear_cpu), ("c", linear_c)):
        grad = backend == ANY
        r.register("moe_experts", "fast", partial(moe_experts_grouped, linear=linear), "tokens grouped per expert", backend, grad)
        sized = partial(moe_experts_sized, linear=linear, batched_c=moe_experts_batched_c if backend == "c" else None)
        r.register("moe_experts", "sized", sized, "single-token / batched / grouped by the step's pairs (ops/thresholds.py)", backend, grad)
    r.register("moe_experts", "static", moe_experts_static, "every expert over every token, fixed shapes (capturable in a graph)", differentiable=True)
    r.register("moe_experts", "triton", moe_experts_triton, "packed MXFP4 experts, Triton grouped GEMM decoding in registers", backend="cuda", requires=TRITON)
    r.register_auto("moe_experts", lambda t: "sized")

    # AttnRes is evaluated by the model itself (model/attn_res.py); the registry holds its names and its rule
    for name, summary in (("naive", "one-shot mix per sublayer"), ("fast", "two-phase, phase 1 once per block"), ("sized", "one-shot below 64 tokens")):
        r.register("attn_res", name, None, summary, differentiable=True)
    r.register_auto("attn_res", lambda t: "sized")
    return r


def op(name: str, impl: str, target: OpTarget = CPU_INFERENCE) -> Callable[..., Any]:
    """The function of `name` implemented as `impl` (or "auto") for `target`."""
    return registry().get(name, impl, target)

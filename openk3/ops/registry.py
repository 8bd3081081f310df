"""Implementations chosen by name: one registry keyed by (op, implementation, backend), instead of a table per op.

Each op has a reference implementation "naive" (its definition, differentiable) and faster ones; "auto" is not an
implementation but a rule, resolved once for a target -- the device, the dtype and whether autograd will run -- when the
model is built or prepared for serving (K3ForCausalLM.select_ops), never per call inside a forward.

A backend is where an entry runs. The same name may be registered for several; a target takes the first it offers
(OpTarget.backends), so a faster backend plugs in as entries of its own and no op asks "is my kernel there?" per call:
- "c": the C kernels of ops/cpu (CPU, fp32, inference), offered only where every one of them builds and loads;
- "cpu": torch's CPU-only forms (oneDNN's blocked weights, weight-first products; CPU, fp32, inference);
- "c_bf16": the C kernels of ops/cpu that read a bf16 cache (CPU, bf16, inference), where the C kernels build: MLA decode;
- "cpu_half": torch's CPU-only forms that take bf16 and fp16 (CPU, bf16/fp16, inference): the MLA latent prefill;
- a device type ("cuda", ...): that device's kernels (Triton, fla), offered on that device;
- "any": plain torch ops, on every device and dtype, the only backend training gets on CPU.
An entry of an inference backend refuses a call outside what it was chosen for (autograd on, another dtype or device,
ops/cpu/__init__.py) with an error that says to select again; it never falls back quietly.

A rule reads the target and, where an op runs beside another, how its caller uses it (OpUse): the KDA decode form pairs
with the layer's prefill form (the definitions with "naive", fla's recurrence with fla's chunks) and takes the fused C
kernel only for head dims it holds. Every entry is a function: the model calls what the registry hands it and never asks
which form it got.

Per-call size policies that are part of an implementation (moe "sized": single-token / batched / grouped by the step's
pairs; linear: C rows kernel / weight-first / oneDNN by rows and weight size; AttnRes "sized": one-shot below 64 tokens;
KDA "mixed": one-token sequences to the decode recurrence; MLA prefill "sized": expanded K/V up to a byte bound) keep their
switches in ops/thresholds.py with the measurements.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

ANY = "any"
HALF_DTYPES = (torch.bfloat16, torch.float16)  # the CPU inference dtypes the "cpu_half" backend serves


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
        if self.training:
            return (ANY,)
        if self.dtype == torch.bfloat16 and self.c_kernels and kernels_available():
            return ("c_bf16", "cpu_half", ANY)
        if self.dtype in HALF_DTYPES:
            return ("cpu_half", ANY)
        if self.dtype != torch.float32:
            return (ANY,)
        return ("c", "cpu", ANY) if self.c_kernels and kernels_available() else ("cpu", ANY)


@dataclass(frozen=True)
class OpUse:
    """What "auto" may read besides the target: how the caller runs the op (fields it does not know stay None)."""

    paired_with: str | None = None  # the resolved name of the op this one runs beside (kda_decode: the layer's kda_prefill)
    head_dim: int | None = None  # the attention head size (kernels that hold a head in registers or on the stack)
    chunk_size: int | None = None  # the block size of chunkwise forms (bound to the entries that take one; None: theirs)


@dataclass(frozen=True)
class Implementation:
    fn: Callable[..., Any]
    differentiable: bool
    summary: str
    backend: str = ANY
    requires: tuple[str, ...] = ()  # modules an optional dependency provides (imported on first call, checked by engines at start-up)
    chunked: bool = False  # takes chunk_size= (OpUse.chunk_size)


CPU_INFERENCE = OpTarget()  # what a model is built for until a trainer or the serving runner selects again
UNSTATED_USE = OpUse()  # a caller that says nothing of how it runs the op

AutoRule = Callable[[OpTarget, OpUse], str]  # the implementation's name for a target and a use


class OpRegistry:
    def __init__(self) -> None:
        self._impls: dict[tuple[str, str, str], Implementation] = {}
        self._auto: dict[str, AutoRule] = {}

    def register(
        self,
        op: str,
        impl: str,
        fn: Callable[..., Any],
        summary: str,
        backend: str = ANY,
        differentiable: bool = False,
        requires: tuple[str, ...] = (),
        chunked: bool = False,
    ) -> None:
        key = (op, impl, backend)
        if key in self._impls:
            raise ValueError(f"OpRegistry: {op}/{impl} is already registered for backend {backend!r}")
        if impl == "auto":
            raise ValueError(f"OpRegistry: 'auto' is a rule (register_auto), not an implementation of {op}")
        self._impls[key] = Implementation(fn, differentiable, summary, backend, requires, chunked)

    def register_auto(self, op: str, rule: AutoRule) -> None:
        self._auto[op] = rule

    def names(self, op: str) -> list[str]:
        """The implementation names of `op` (on any backend), and "auto" when it has a rule."""
        names = sorted({impl for o, impl, _ in self._impls if o == op})
        if not names:
            raise ValueError(f"unknown op {op!r}: registered ops are {sorted({o for o, _, _ in self._impls})}")
        return names + (["auto"] if op in self._auto else [])

    def entry(self, op: str, impl: str, target: OpTarget = CPU_INFERENCE, use: OpUse = UNSTATED_USE) -> tuple[str, Implementation]:
        """(the implementation's name, its entry) for `impl` on `target`: "auto" resolved by the op's rule for `target` and
        `use`, the entry of the first backend the target offers; refuses a non-differentiable implementation for training."""
        names = self.names(op)
        if impl not in names:
            raise ValueError(f"{op}: implementation {impl!r} is unknown: expected one of {names}")
        name = self._auto[op](target, use) if impl == "auto" else impl
        backends = target.backends()
        found = next((e for b in backends if (e := self._impls.get((op, name, b))) is not None), None)
        if found is None:
            raise ValueError(f"{op}: implementation {name!r} is not available on {target} (backends {list(backends)})")
        if target.training and not found.differentiable:
            differentiable = sorted({i for (o, i, _), e in self._impls.items() if o == op and e.differentiable})
            raise ValueError(f"{op}: implementation {name!r} is inference-only; for training choose one of {differentiable}")
        return name, found

    def get(self, op: str, impl: str, target: OpTarget = CPU_INFERENCE, use: OpUse = UNSTATED_USE) -> Callable[..., Any]:
        """The function of `impl` (or "auto") for `target` and `use`, with use.chunk_size bound where the form takes one."""
        found = self.entry(op, impl, target, use)[1]
        if found.chunked and use.chunk_size is not None:
            return functools.partial(found.fn, chunk_size=use.chunk_size)
        return found.fn


FLA_PREFILLS = ("fla", "fla_recurrent")  # the "kda_prefill" forms that run fla's kernels (ops/kda/fla_kernels.py)


def kda_decode_rule(target: OpTarget, use: OpUse) -> str:
    """The decode form beside prefill form `use.paired_with`: the definitions beside "naive" (rule 1: the reference runs on
    every kind of step) and for training; fla's recurrence beside fla's kernels (decode tokens as one-token sequences of
    one varlen call); the fused C kernel where the target offers it and a head fits it; else the in-pool torch ops."""
    from openk3.ops.kda.decode_fused import MAX_HEAD_DIM  # here, as registry() imports the ops: ops/ stays acyclic

    if use.paired_with == "naive" or target.training:
        return "naive"
    if use.paired_with in FLA_PREFILLS:
        return "fla"
    if "c" in target.backends() and use.head_dim is not None and use.head_dim <= MAX_HEAD_DIM:
        return "fused"
    return "in_pool"


def mla_prefill_rule(target: OpTarget, _: OpUse) -> str:
    """The latent CPU flash form where the target offers it (CPU inference in fp32, bf16 or fp16: faster than expanded SDPA
    at every size measured, 1.6-6.9x the expanded SDPA from 1 x 1 to 2048 x 32768 in fp32, benchmarks/results/long_context.md;
    its memory is the cached latents); for inference elsewhere SDPA over expanded K/V until its bytes reach a bound, key
    blocks past it ("sized"); for training SDPA over expanded K/V (differentiable)."""
    if target.training:
        return "fast"
    return "latent" if {"cpu", "cpu_half"} & set(target.backends()) else "sized"


@functools.cache
def registry() -> OpRegistry:
    """The built-in implementations (made once per process, on first use: importing the ops here keeps ops/ acyclic)."""
    from openk3.ops.activation import glu
    from openk3.ops.argmax_c import argmax_rows, argmax_rows_c
    from openk3.ops.attn_res import OneShotStream, TwoPhaseStream, attn_res_sized
    from openk3.ops.attn_res.mix_c import attn_res_sized_c
    from openk3.ops.glu_c import glu_c
    from openk3.ops.kda import decode_step
    from openk3.ops.kda.chunk import kda_chunk
    from openk3.ops.kda.chunk_autograd import kda_chunk_autograd
    from openk3.ops.kda.chunk_c import kda_chunk_c, kda_mixed_c
    from openk3.ops.kda.fla_kernels import kda_chunk_fla, kda_recurrent_fla
    from openk3.ops.kda.layer_c import kda_layer_decode_c, kda_layer_decode_reference
    from openk3.ops.kda.mixed import kda_mixed
    from openk3.ops.kda.naive import kda_recurrent
    from openk3.ops.linear import linear_c, linear_cpu, linear_torch
    from openk3.ops.mla.absorbed import mla_absorbed, mla_decode_paged
    from openk3.ops.mla.blockwise import mla_blockwise, mla_expanded_or_blockwise
    from openk3.ops.mla.decode_cpu import latent_attention_c, latent_attention_c_bf16
    from openk3.ops.mla.inputs_c import mla_decode_inputs_c, mla_decode_inputs_reference
    from openk3.ops.mla.latent_flash import mla_latent_flash
    from openk3.ops.mla.naive import mla_expanded
    from openk3.ops.mla.sdpa import mla_expanded_sdpa
    from openk3.ops.moe import moe_experts_sized
    from openk3.ops.moe.batched import moe_experts_batched
    from openk3.ops.moe.block_c import moe_latent_block_c, moe_latent_block_reference, moe_routed_latent_block_c, moe_routed_latent_block_reference
    from openk3.ops.moe.cpu_pairs import moe_experts_batched_c
    from openk3.ops.moe.grouped import moe_experts_grouped
    from openk3.ops.moe.naive import moe_experts_naive
    from openk3.ops.moe.packed_c import moe_experts_packed_c
    from openk3.ops.moe.router import sigmoid_topk_route, sigmoid_topk_route_c
    from openk3.ops.moe.static import moe_experts_static
    from openk3.ops.mxfp4 import dequantize, dequantize_naive
    from openk3.ops.mxfp4_c import dequantize_c
    from openk3.ops.norm import rms_norm, rms_norm_c, rms_norm_reference
    from openk3.ops.short_conv import fast as conv_fast
    from openk3.ops.short_conv import naive as conv_naive
    from openk3.ops.triton import latent_attention_triton, mla_prefill_triton, moe_experts_triton
    from openk3.ops.vision_attn import vision_attention_naive, vision_attention_sdpa

    partial = functools.partial
    FLA, TRITON = ("fla.ops.kda",), ("triton",)  # the gpu extra's packages (fla-core, triton), imported by their entries on first call
    r = OpRegistry()
    r.register("linear", "naive", linear_torch, "F.linear (the definition)", differentiable=True)
    r.register("linear", "fast", linear_cpu, "weight-first / oneDNN (packed weights) by rows and weight size", backend="cpu")
    r.register("linear", "fast", linear_c, "the C few-row kernel up to 16 rows, then the CPU forms", backend="c")
    r.register_auto("linear", lambda t, _: "fast" if "cpu" in t.backends() else "naive")

    r.register("rms_norm", "naive", rms_norm_reference, "spelled out (the definition)", differentiable=True)
    r.register("rms_norm", "fast", rms_norm, "torch's fused rms_norm in fp32", differentiable=True)
    r.register("rms_norm", "fast", rms_norm_c, "one C loop over the rows", backend="c")
    r.register_auto("rms_norm", lambda t, _: "fast")

    r.register("glu", "naive", glu, "SiLU / SiTU gate times up in torch ops (the definition)", differentiable=True)
    r.register("glu", "fast", glu_c, "one C loop over the rows", backend="c")
    r.register_auto("glu", lambda t, _: "fast" if "c" in t.backends() else "naive")

    r.register("argmax_rows", "naive", argmax_rows, "torch.argmax over each row (the definition)")
    r.register("argmax_rows", "fast", argmax_rows_c, "one C loop over the rows, torch.argmax's tie and NaN rules", backend="c")
    r.register_auto("argmax_rows", lambda t, _: "fast" if "c" in t.backends() else "naive")

    r.register("kda_prefill", "naive", kda_recurrent, "the per-token recurrence (the definition)", differentiable=True)
    r.register("kda_prefill", "fast", kda_chunk, "chunkwise WY form, buffers updated in place (inference)", chunked=True)
    r.register("kda_prefill", "autograd", kda_chunk_autograd, "chunkwise WY form without in-place updates (training)", differentiable=True, chunked=True)
    # fla's kernels (ops/kda/fla_kernels.py, fla imported on first call): chosen by name, like the Triton entries below
    r.register("kda_prefill", "fla", kda_chunk_fla, "fla's chunk_kda, states converted at the seam", backend="cuda", requires=FLA)
    r.register("kda_prefill", "fla_recurrent", kda_recurrent_fla, "fla's fused_recurrent_kda (decode-sized steps)", backend="cuda", requires=FLA)
    r.register("kda_prefill", "mixed", kda_mixed, "one-token sequences to the decode recurrence, the rest chunkwise (inference)", chunked=True)
    # the same two forms with the state-independent work in one C pass per chunk (ops/kda/chunk_c.py)
    r.register("kda_prefill", "fast", kda_chunk_c, "chunkwise WY form, its intra-chunk part in one C pass (inference)", backend="c", chunked=True)
    r.register("kda_prefill", "mixed", kda_mixed_c, "as mixed, the chunkwise part by the C form (inference)", backend="c", chunked=True)
    r.register_auto("kda_prefill", lambda t, _: "autograd" if t.training else "mixed")

    r.register("short_conv", "naive", conv_naive.causal_conv1d, "per-sequence loops (the definition)", differentiable=True)
    r.register("short_conv", "fast", conv_fast.causal_conv1d, "one grouped conv over the packed batch", differentiable=True)
    r.register_auto("short_conv", lambda t, _: "fast")

    r.register("mla_prefill", "naive", mla_expanded, "K/V expanded, explicit softmax (the definition)", differentiable=True)
    r.register("mla_prefill", "fast", mla_expanded_sdpa, "K/V expanded, torch's SDPA", differentiable=True)
    r.register("mla_prefill", "absorbed", mla_absorbed, "attention in the latent space (the decode form)", differentiable=True)
    r.register("mla_prefill", "blockwise", mla_blockwise, "K/V expanded one key block at a time, online softmax", differentiable=True)
    # by name only, like the other Triton entries below ("auto" stays on the torch forms until a hardware run)
    r.register("mla_prefill", "triton", mla_prefill_triton, "the chunk's latent attention as a causal Triton kernel, no K/V", backend="cuda", requires=TRITON)
    latent_summary = "latent space, torch's CPU flash kernel: no K/V, no chunk x context scores"
    r.register("mla_prefill", "latent", mla_latent_flash, latent_summary, backend="cpu")
    r.register("mla_prefill", "latent", mla_latent_flash, latent_summary + " (bf16/fp16)", backend="cpu_half")
    r.register("mla_prefill", "sized", mla_expanded_or_blockwise, "SDPA over expanded K/V up to a byte bound, key blocks above (ops/thresholds.py)")
    r.register_auto("mla_prefill", mla_prefill_rule)

    r.register("mla_decode", "naive", mla_decode_paged, "absorbed query over the gathered pages, torch ops", differentiable=True)
    r.register("mla_decode", "fast", partial(mla_decode_paged, latent_attention=latent_attention_c), "the latent attention in one C call", backend="c")
    # Triton (ops/triton/, imported on first call): chosen by name; "auto" keeps the torch forms on CUDA until docs/gpu.md's
    # hardware run has passed
    triton_decode = partial(mla_decode_paged, latent_attention=latent_attention_triton)
    r.register("mla_decode", "triton", triton_decode, "the latent attention as a paged Triton kernel", backend="cuda", requires=TRITON)
    bf16_decode = partial(mla_decode_paged, latent_attention=latent_attention_c_bf16)
    r.register("mla_decode", "fast", bf16_decode, "the latent attention in one C call over the bf16 pages (fp32 inside)", backend="c_bf16")
    r.register_auto("mla_decode", lambda t, _: "fast" if {"c", "c_bf16"} & set(t.backends()) else "naive")
    r.register("mla_decode_inputs", "naive", mla_decode_inputs_reference, "projections, norms, latent write in torch ops", differentiable=True)
    r.register("mla_decode_inputs", "fast", mla_decode_inputs_c, "projections, norms and latent write in one C call", backend="c")
    r.register_auto("mla_decode_inputs", lambda t, _: "fast" if "c" in t.backends() else "naive")

    # a layer's decode step from its projections on (ops/kda/decode_step.py); "auto" pairs it with the prefill (kda_decode_rule)
    naive_step = decode_step.kda_decode_step_naive
    r.register("kda_decode", "naive", naive_step, "conv and delta rule on gathered slots: old state in, new state out", differentiable=True)
    r.register("kda_decode", "in_pool", decode_step.kda_decode_step_in_pool, "conv windows and states advanced in place in the pools, torch ops")
    r.register("kda_decode", "fused", decode_step.kda_decode_step_fused, "the whole step after the projections in one C call", backend="c")
    r.register("kda_decode", "fla", decode_step.kda_decode_step_fla, "fla's fused_recurrent_kda over one-token sequences", backend="cuda", requires=FLA)
    r.register_auto("kda_decode", kda_decode_rule)
    r.register("kda_layer_decode", "naive", kda_layer_decode_reference, "projections, the decode step's definition, o_proj", differentiable=True)
    r.register("kda_layer_decode", "fast", kda_layer_decode_c, "projections, decode step and o_proj in one C call", backend="c")
    r.register_auto("kda_layer_decode", lambda t, _: "fast" if "c" in t.backends() else "naive")

    r.register("moe_route", "naive", sigmoid_topk_route, "sigmoid, biased top-k, renormalise in torch ops", differentiable=True)
    r.register("moe_route", "fast", sigmoid_topk_route_c, "the steps after the logits in one C loop", backend="c")
    r.register_auto("moe_route", lambda t, _: "fast" if "c" in t.backends() else "naive")

    r.register("moe_latent_block", "naive", moe_latent_block_reference, "latent MoE after the router in torch ops (the definition)", differentiable=True)
    r.register("moe_latent_block", "fast", moe_latent_block_c, "projections, experts, norm and shared experts in one C call", backend="c")
    r.register_auto("moe_latent_block", lambda t, _: "fast" if "c" in t.backends() else "naive")
    r.register("moe_routed_latent_block", "naive", moe_routed_latent_block_reference, "the router in torch ops, then moe_latent_block's definition")
    r.register("moe_routed_latent_block", "fast", moe_routed_latent_block_c, "the top-k after the router's logits and the block in one C call", backend="c")
    r.register_auto("moe_routed_latent_block", lambda t, _: "fast" if "c" in t.backends() else "naive")

    r.register("moe_experts", "naive", moe_experts_naive, "per-token, per-expert loop (the definition)", differentiable=True)
    r.register("moe_experts", "batched", moe_experts_batched, "all experts as one padded batch (dense banks)", differentiable=True)
    r.register("moe_experts", "batched", moe_experts_batched_c, "the pair bookkeeping and the expert MLPs in C", backend="c")
    for backend, linear in ((ANY, linear_torch), ("cpu", linear_cpu), ("c", linear_c)):
        grad = backend == ANY
        r.register("moe_experts", "fast", partial(moe_experts_grouped, linear=linear), "tokens grouped per expert", backend, grad)
        c = backend == "c"
        sized = partial(moe_experts_sized, linear=linear, batched_c=moe_experts_batched_c if c else None, packed_c=moe_experts_packed_c if c else None)
        r.register("moe_experts", "sized", sized, "single-token / batched / grouped by the step's pairs (ops/thresholds.py)", backend, grad)
    r.register("moe_experts", "static", moe_experts_static, "every expert over every token, fixed shapes (capturable in a graph)", differentiable=True)
    r.register("moe_experts", "triton", moe_experts_triton, "packed MXFP4 experts, Triton grouped GEMM decoding in registers", backend="cuda", requires=TRITON)
    r.register_auto("moe_experts", lambda t, _: "sized")
    # how a packed MXFP4 bank decodes the experts a step picked (ops/moe/packed_bank.py); all forms give the same bits
    r.register("mxfp4_decode", "naive", dequantize_naive, "nibbles split, fp64 values, one rounding (the definition)", differentiable=True)
    r.register("mxfp4_decode", "fast", dequantize, "a byte-pair gather and a scale multiply in torch", differentiable=True)
    r.register("mxfp4_decode", "fast", dequantize_c, "the same tables in one C loop (fp32)", backend="c")
    r.register_auto("mxfp4_decode", lambda t, _: "fast")

    # the residual stream over depth of one forward (ops/attn_res/stream.py): embedding in, a stream the layer loop reads and adds to
    r.register("attn_res", "naive", OneShotStream, "one-shot mix per sublayer (the definition)", differentiable=True)
    r.register("attn_res", "fast", TwoPhaseStream, "two-phase: phase 1 once per block, a merge per sublayer", differentiable=True)
    r.register("attn_res", "sized", attn_res_sized, "one-shot below 64 tokens, two-phase from there", differentiable=True)
    r.register("attn_res", "sized", attn_res_sized_c, "as sized, the one-shot reads in one C call each", backend="c")
    r.register_auto("attn_res", lambda t, _: "sized")

    r.register("vision_attn", "naive", vision_attention_naive, "explicit softmax per image in fp32 (the definition)", differentiable=True)
    r.register("vision_attn", "fast", vision_attention_sdpa, "torch's SDPA, one call per image", differentiable=True)
    r.register_auto("vision_attn", lambda t, _: "fast")
    return r


def op(name: str, impl: str, target: OpTarget = CPU_INFERENCE) -> Callable[..., Any]:
    """The function of `name` implemented as `impl` (or "auto") for `target`."""
    return registry().get(name, impl, target)

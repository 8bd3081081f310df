"""parallelize_tensor: cut a built K3ForCausalLM down to one tensor-parallel rank's part, in place, from outside the
model (torchtitan's parallelize.py style; what is split is layout.py's list). Works on real weights (a preset's seeded
model, a caller's module) and on the meta device (a checkpoint is then read shard by shard: model/weights.py's `layout`).

Legend: T ranks, r this rank, H heads, P = H * K projection width, I intermediate width, V vocabulary.
A split keeps rows (or columns) r * n / T .. (r + 1) * n / T - 1 of the split dimension. Heads are contiguous rows in
every projection (q/k/v/f_b/b/g of KDA, q_b/kv_b/g of MLA), so a head-block split is a row-block split; a row-parallel
o_proj or down_proj keeps the matching columns. Must run before prepare_for_serving (which ties the projections it finds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from openk3.model.kda import KimiDeltaAttention
from openk3.model.layers import GatedMLP, Linear
from openk3.model.mla import GatedMLA
from openk3.model.model import K3ForCausalLM
from openk3.model.moe import DenseExperts, LatentMoE, LocalExperts, PackedExperts
from openk3.ops.moe.router import RouterOutput
from openk3.ops.registry import CPU_INFERENCE, OpTarget
from openk3.parallel.group import ParallelContext
from openk3.parallel.tp.layout import check_tensor_parallel, rank_config
from openk3.parallel.tp.modules import RowParallelLinear, VocabParallelEmbedding, VocabParallelHead, all_reduce_sum


@dataclass
class TensorSplits:
    """Which state-dict keys this rank holds a part of, and along which dimension (model/weights.py's TensorSlices)."""

    parts: int
    index: int
    dims: dict[str, int] = field(default_factory=dict)

    def dim_of(self, key: str) -> int | None:
        return self.dims.get(key)


class ExpertSlices:
    """Routed experts split by intermediate width (tensor parallelism without expert parallelism): every rank runs every
    token through its I/T slice of each chosen expert; the partial outputs are summed by one all-reduce. Exact because
    each expert is act(w1 x) * (w3 x) per intermediate unit followed by the linear w2."""

    def __init__(self, ctx: ParallelContext, impl: str = "auto", target: OpTarget = CPU_INFERENCE) -> None:
        self.ctx = ctx
        self.select(impl, target)

    def select(self, impl: str, target: OpTarget) -> None:
        self.local = LocalExperts(impl, target)

    def __call__(self, layer: LatentMoE, z_TD: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        return all_reduce_sum(self.ctx, self.local(layer, z_TD, routing))


class _Cutter:
    def __init__(self, model: nn.Module, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self.names = {id(m): name for name, m in model.named_modules()}
        self.splits = TensorSplits(ctx.world_size, ctx.rank)

    def cut(self, module: nn.Module, attr: str, dim: int) -> torch.Tensor:
        """Replace module.attr by this rank's block along `dim` (a new tensor: the full one can be freed)."""
        full = getattr(module, attr)
        n = full.shape[dim] // self.ctx.world_size
        piece = full.detach().narrow(dim, self.ctx.rank * n, n).clone()
        if isinstance(full, nn.Parameter):
            setattr(module, attr, nn.Parameter(piece, requires_grad=full.requires_grad))
        else:
            module.register_buffer(attr, piece)
        prefix = self.names[id(module)]
        self.splits.dims[f"{prefix}.{attr}" if prefix else attr] = dim
        return piece

    def column(self, linear: Linear) -> None:
        linear.out_features = self.cut(linear, "weight", 0).shape[0]

    def row(self, parent: nn.Module, attr: str) -> None:
        linear = getattr(parent, attr)
        self.cut(linear, "weight", 1)
        linear.in_features = linear.weight.shape[1]
        setattr(parent, attr, RowParallelLinear(linear, self.ctx))

    def conv(self, conv: nn.Conv1d) -> None:
        channels = self.cut(conv, "weight", 0).shape[0]
        conv.in_channels = conv.out_channels = conv.groups = channels

    def kda(self, attn: KimiDeltaAttention) -> None:
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj, attn.f_b_proj, attn.b_proj):
            self.column(linear)
        self.column(attn.g_proj if attn.full_rank_output_gate else attn.g_b_proj)
        for conv in (attn.q_conv1d, attn.k_conv1d, attn.v_conv1d):
            self.conv(conv)
        self.cut(attn, "A_log", 0)
        self.cut(attn, "dt_bias", 0)
        self.row(attn, "o_proj")
        attn.num_heads //= self.ctx.world_size

    def mla(self, attn: GatedMLA) -> None:
        self.column(attn.q_b_proj if attn.q_lora else attn.q_proj)
        self.column(attn.kv_b_proj)
        if attn.output_gate:
            self.column(attn.g_proj)
        self.row(attn, "o_proj")
        attn.num_heads //= self.ctx.world_size

    def mlp(self, mlp: GatedMLP) -> None:
        self.column(mlp.gate_proj)
        self.column(mlp.up_proj)
        self.row(mlp, "down_proj")
        mlp.intermediate //= self.ctx.world_size

    def experts(self, moe: LatentMoE) -> None:
        """Every expert's intermediate slice: w1/w3 rows, w2 columns (packed: bytes and E8M0 scale blocks alike)."""
        experts = moe.experts
        if isinstance(experts, DenseExperts):
            self.cut(experts, "w1", 1)
            self.cut(experts, "w3", 1)
            self.cut(experts, "w2", 2)
        else:
            assert isinstance(experts, PackedExperts)
            for w, dim in (("w1", 1), ("w3", 1), ("w2", 2)):
                self.cut(experts, f"{w}_weight_packed", dim)
                self.cut(experts, f"{w}_weight_scale", dim)
        moe.backend = ExpertSlices(self.ctx)

    def vocabulary(self, model: K3ForCausalLM) -> None:
        embed = model.model.embed_tokens
        tied = model.lm_head.weight is embed.weight
        self.cut(embed, "weight", 0)
        rows = embed.weight.shape[0]
        model.model.embed_tokens = VocabParallelEmbedding(embed.weight.data, self.ctx.rank * rows, self.ctx)  # type: ignore[assignment]
        if tied:
            model.lm_head.weight = model.model.embed_tokens.weight
        else:
            self.cut(model.lm_head, "weight", 0)
        model.lm_head.out_features = rows
        model.lm_head = VocabParallelHead(model.lm_head, self.ctx)


def parallelize_tensor(model: K3ForCausalLM, ctx: ParallelContext, split_experts: bool) -> TensorSplits:
    """Cut `model` to rank ctx.rank of ctx.world_size tensor-parallel ranks, in place, and return what was split.

    split_experts: also split every routed expert by intermediate width (no expert parallelism); False leaves the
    experts whole for an expert-parallel backend to cut by expert. model.config becomes the rank's (layout.rank_config),
    so an engine sizes its KDA state slots for the rank's heads."""
    check_tensor_parallel(model.config, ctx.world_size, split_experts)
    cutter = _Cutter(model, ctx)
    if ctx.world_size == 1:
        return cutter.splits
    for layer in model.model.layers:
        attn = layer.self_attn
        if isinstance(attn, KimiDeltaAttention):
            cutter.kda(attn)
        else:
            assert isinstance(attn, GatedMLA)
            cutter.mla(attn)
        if not layer.is_moe:
            cutter.mlp(layer.mlp)
            continue
        moe = layer.block_sparse_moe
        if moe.shared_experts is not None:
            cutter.mlp(moe.shared_experts)
        if split_experts:
            cutter.experts(moe)
    cutter.vocabulary(model)
    model.config = rank_config(model.config, ctx.world_size)
    return cutter.splits

"""K3ForCausalLM: embed -> hybrid decoder layers (KDA / gated MLA, dense or LatentMoE MLP) -> AttnRes output mixer -> norm -> head.

Legend: T packed tokens of the step, D hidden, V vocab, M rows whose logits are wanted.
One forward serves training (no cache), full prefill, chunked prefill and decode: everything about the step is in the
`ForwardBatch`, and the cache pools are passed explicitly (`CacheTensors`). Parameter names follow the K3 checkpoint
(`model.layers.{i}.self_attn.*`, `block_sparse_moe.*`, `mlp.*`, `*_res_proj`, `lm_head`), so `state_dict()` keys are the
official names except for the routed experts, which are stacked per layer (weights.py maps both ways).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import cast, overload

import torch
from torch import nn

from openk3.checks import check_int, fail
from openk3.config import LayerKind, ModelConfig
from openk3.config.vision import VisionConfig
from openk3.model.attn_res import PlainResidual, mix_query, new_mixer
from openk3.model.batch import CacheTensors, ForwardBatch
from openk3.model.kda import KDALayerCache, KimiDeltaAttention
from openk3.model.layers import GatedMLP, Linear, RMSNorm
from openk3.model.mla import GatedMLA
from openk3.model.moe import DenseExperts, ExpertBackend, LatentMoE, LocalExperts, PackedExperts, Router, SelectsExpertOps
from openk3.model.vision import MoonViT
from openk3.model.vision_projector import PatchMergerProjector, tpool_merge
from openk3.ops.attn_res import DepthStream, MixQuery
from openk3.ops.registry import CPU_INFERENCE, OpTarget, op


@dataclass(frozen=True)
class OpChoice:
    """Implementations chosen by name (rule 1; ops/registry.py lists them): "naive" is the reference, "auto" the best for
    the target the model is built or prepared for (e.g. kda: "mixed" for inference, "autograd" for training)."""

    kda: str = "auto"
    conv: str = "auto"
    mla: str = "auto"  # the MLA prefill attention ("mla_prefill")
    mla_decode: str = "auto"  # the paged MLA decode attention ("mla_decode"); "auto" is the definition's torch ops when mla is "naive"
    moe: str = "auto"
    attn_res: str = "auto"  # "naive": one-shot mix per sublayer; "fast": two-phase (phase 1 once per AttnRes block); "sized": by step size
    linear: str = "auto"  # the bias-free projections ("naive": F.linear; "fast": the CPU forms, ops/linear.py)
    norm: str = "auto"  # every RMSNorm
    route: str = "auto"  # the MoE router's top-k ("moe_route")
    glu: str = "auto"  # the gated MLPs' activation (shared experts, dense MLP; "glu")
    vision_attn: str = "auto"  # the vision tower's attention within each image ("vision_attn")
    kda_chunk_size: int | None = None  # chunk length of the chunkwise KDA forms (None: their default)
    packed_experts: bool = False  # routed experts as packed MXFP4 buffers (serving K3 checkpoints) instead of dense parameters

    def __post_init__(self) -> None:
        size = self.kda_chunk_size
        check_int("OpChoice", "kda_chunk_size", size, low=1, optional=True)
        if size is not None and size & (size - 1):
            fail("OpChoice", "kda_chunk_size", size, "None or a power of two (the chunkwise KDA forms' block size)")


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, ops: OpChoice) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.index, self.kind = index, config.layer_kind(index)
        self.self_attn: nn.Module = GatedMLA(config, ops.mla) if self.kind == LayerKind.MLA else KimiDeltaAttention(config, ops.kda, ops.conv)
        self.is_moe = config.is_moe_layer(index)
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(config, index, LocalExperts(ops.moe), packed_experts=ops.packed_experts)
        else:
            self.mlp = GatedMLP(d, config.intermediate_size, config.hidden_act, config.situ_beta, config.situ_linear_beta)
        self.input_layernorm = RMSNorm(d, eps)
        self.post_attention_layernorm = RMSNorm(d, eps)
        self.attn_res = config.attn_res_block_size is not None
        if self.attn_res:
            self.self_attention_res_proj, self.self_attention_res_norm = new_mixer(d, eps)
            self.mlp_res_proj, self.mlp_res_norm = new_mixer(d, eps)

    def mixers(self) -> tuple[MixQuery | None, MixQuery | None]:
        """The AttnRes mixers of (attention's, the MLP's) input, keyed 2i and 2i + 1; None without AttnRes."""
        if not self.attn_res:
            return None, None
        return (
            mix_query(2 * self.index, self.self_attention_res_proj, self.self_attention_res_norm),
            mix_query(2 * self.index + 1, self.mlp_res_proj, self.mlp_res_norm),
        )

    def feed_forward(self, x_TD: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x_TD) if self.is_moe else self.mlp(x_TD)

    def attention(self, x_TD: torch.Tensor, batch: ForwardBatch, cache: CacheTensors | None, cache_index: int) -> torch.Tensor:
        h = self.input_layernorm(x_TD)
        if self.kind == LayerKind.MLA:
            return self.self_attn(h, batch, cache.mla_latent[cache_index] if cache is not None else None)
        layer_cache = KDALayerCache(cache.kda_state[cache_index], cache.conv_state[cache_index]) if cache is not None else None
        return self.self_attn(h, batch, layer_cache)


class DecoderLayers(nn.ModuleList):
    """`model.layers` (the checkpoint's `model.layers.{i}.*`): a ModuleList that hands out its items as DecoderLayer."""

    def __iter__(self) -> Iterator[DecoderLayer]:
        return cast(Iterator[DecoderLayer], super().__iter__())

    @overload
    def __getitem__(self, idx: slice) -> DecoderLayers: ...

    @overload
    def __getitem__(self, idx: int) -> DecoderLayer: ...

    def __getitem__(self, idx: int | slice) -> DecoderLayer | DecoderLayers:
        return cast("DecoderLayer | DecoderLayers", super().__getitem__(idx))


class K3Model(nn.Module):
    def __init__(self, config: ModelConfig, ops: OpChoice) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = DecoderLayers(DecoderLayer(config, i, ops) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.attn_res_block_size is not None:
            self.output_attn_res_proj, self.output_attn_res_norm = new_mixer(config.hidden_size, config.rms_norm_eps)
        # position of each layer inside its kind's cache list (KDA layers and MLA layers are numbered separately)
        kinds = config.layer_kinds
        self.cache_index = [sum(1 for j in range(i) if kinds[j] == kinds[i]) for i in range(config.num_hidden_layers)]
        self.select_depth_stream(ops.attn_res, CPU_INFERENCE)

    def select_depth_stream(self, impl: str, target: OpTarget) -> None:
        """The residual stream over depth (ops/registry.py "attn_res" by name, or the plain sum without AttnRes)."""
        stream: Callable[[torch.Tensor], DepthStream] = op("attn_res", impl, target)
        self.depth_stream = stream if self.config.attn_res_block_size is not None else PlainResidual

    def forward(self, batch: ForwardBatch, cache: CacheTensors | None) -> torch.Tensor:
        return self.forward_with_aux(batch, cache, ())[0]

    def forward_with_aux(self, batch: ForwardBatch, cache: CacheTensors | None, aux_layers: Sequence[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The spec's layer loop over the residual stream (ops/attn_res/stream.py says what each call does): a sublayer
        reads its input from the stream and adds its output to it; an AttnRes block starts by storing the partial sum.
        Also returns, for each id i of `aux_layers` (an EAGLE-3 draft's, model/eagle3.py), the hidden state [T, D] entering
        layer i: the stream's running partial sum after layer i - 1, taken before layer i's block starts. Without AttnRes
        that is the residual stream itself (vLLM's `hidden_states + residual` at the top of layer i); with AttnRes it is
        the sum of the current block's sublayer outputs, the "prefix_sum + hidden_states" vLLM's and TokenSpeed's K3
        capture for the published K3 EAGLE-3 heads -- not the AttnRes mix layer i reads, which depends on layer i's own
        mixer weights."""
        stream = self.depth_stream(self.embed(batch))
        block_size = self.config.attn_res_block_size
        mixers = [layer.mixers() for layer in self.layers]
        output_mixer = self.output_mixer()
        taken: dict[int, torch.Tensor] = {}
        for layer, (attn_mixer, mlp_mixer) in zip(self.layers, mixers, strict=True):
            if layer.index in aux_layers:
                taken[layer.index] = stream.partial()
            if block_size is not None and layer.index % block_size == 0:
                stream.start_block(self._block_readers(layer.index, block_size, mixers, output_mixer))
            stream.add(layer.attention(stream.read(attn_mixer), batch, cache, self.cache_index[layer.index]))
            stream.add(layer.feed_forward(layer.post_attention_layernorm(stream.read(mlp_mixer))))
        return self.norm(stream.read(output_mixer)), [taken[i] for i in aux_layers]

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """The token embeddings [T, D], with the rows of media placeholders replaced by their image embeddings (the
        projected patches, K3ForCausalLM.encode_images) where the batch carries them."""
        x_TD = self.embed_tokens(batch.input_ids)
        if batch.mm_embeds is None or batch.mm_rows is None:
            return x_TD
        if batch.mm_embeds.shape != (batch.mm_rows.numel(), x_TD.shape[1]):
            raise ValueError(
                f"mm_embeds has shape {tuple(batch.mm_embeds.shape)}, expected ({batch.mm_rows.numel()}, {x_TD.shape[1]}): one row per mm_rows entry"
            )
        return x_TD.index_copy(0, batch.mm_rows, batch.mm_embeds.to(x_TD.dtype))

    def output_mixer(self) -> MixQuery | None:
        if self.config.attn_res_block_size is None:
            return None
        return mix_query(2 * self.config.num_hidden_layers, self.output_attn_res_proj, self.output_attn_res_norm)

    def _block_readers(self, start: int, block_size: int, mixers: list[tuple[MixQuery | None, MixQuery | None]], output: MixQuery | None) -> list[MixQuery]:
        """The mixers that read the block set stored at layer `start`: attention and MLP mixers of the block's layers, and
        the output mixer after the last block. Layer 0's attention mixer is left out: it reads the embedding unmixed."""
        end = min(start + block_size, self.config.num_hidden_layers)
        readers = [m for i in range(start, end) for m in (mixers[i] if i > 0 else mixers[i][1:])]
        if end == self.config.num_hidden_layers:
            readers.append(output)
        return [m for m in readers if m is not None]


def select_block_ops(root: nn.Module, ops: OpChoice, target: OpTarget, previous_moe: str) -> None:
    """Choose the implementations of every building block and decoder layer under `root` by name (K3ForCausalLM.select_ops,
    and a draft layer of the same blocks: model/mtp.py). `previous_moe`: the MoE name the experts followed until now (a
    name set on an expert backend itself is kept)."""
    for module in root.modules():
        if isinstance(module, Linear):
            module.select(target, ops.linear)
        elif isinstance(module, RMSNorm):
            module.select(target, ops.norm)
        elif isinstance(module, Router):
            module.select(target, ops.route)
        elif isinstance(module, GatedMLP):
            module.select(target, ops.glu)
        elif isinstance(module, DecoderLayer):
            attn = module.self_attn
            if isinstance(attn, KimiDeltaAttention):
                attn.select(ops.kda, ops.conv, target, ops.kda_chunk_size)
            elif isinstance(attn, GatedMLA):
                attn.select(ops.mla, target, ops.mla_decode)
            backend = module.block_sparse_moe.backend if module.is_moe else None
            if isinstance(backend, LocalExperts):
                module.block_sparse_moe.backend = LocalExperts(ops.moe if backend.impl == previous_moe else backend.impl, target)
            elif isinstance(backend, SelectsExpertOps):
                backend.select(ops.moe, target)


class K3ForCausalLM(nn.Module):
    """The text model, and with `vision` the release's MoonViT tower (`vision_tower.*`) and projector (`mm_projector.*`)
    beside it: encode_images gives the embeddings that a ForwardBatch's `mm_embeds` puts at the media placeholders."""

    def __init__(self, config: ModelConfig, ops: OpChoice | None = None, vision: VisionConfig | None = None) -> None:
        super().__init__()
        self.config, self.vision = config, vision
        self.ops = ops or OpChoice()
        self.model = K3Model(config, self.ops)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if vision is not None:
            if vision.text_hidden_size != config.hidden_size:
                raise ValueError(f"vision.text_hidden_size={vision.text_hidden_size} differs from the text model's hidden_size={config.hidden_size}")
            self.vision_tower = MoonViT(vision, self.ops.vision_attn)
            self.mm_projector = PatchMergerProjector(vision)
        self.select_ops(self.ops)  # "auto" for inference on CPU until a trainer or the serving runner selects again

    def encode_images(self, pixels_LCPP: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Text-width embeddings [N, D_text] of packed images or video chunks (grids: (t, h, w) patches each): the tower,
        temporal pooling and the patch merger, the projector; image i's rows follow image i - 1's."""
        if self.vision is None:
            raise ValueError("this model has no vision tower: its config.json declares no vision_config")
        hidden = self.vision_tower(pixels_LCPP, grids)
        return self.mm_projector(tpool_merge(hidden, grids, self.vision.merge_kernel_size))

    def forward(self, batch: ForwardBatch, cache: CacheTensors | None = None) -> torch.Tensor:
        """Logits [M, V] for the rows in `batch.logits_indices` (all T rows when None)."""
        h = self.hidden_states(batch, cache)
        if batch.logits_indices is not None:
            h = h[batch.logits_indices]
        return self.compute_logits(h)

    def hidden_states(self, batch: ForwardBatch, cache: CacheTensors | None = None) -> torch.Tensor:
        """The last hidden state [T, D] of every row (after the final norm): what the head reads, and what a draft layer
        that reads the target's hidden states takes (model/mtp.py)."""
        return self.model(batch, cache)

    def aux_hidden_states(self, batch: ForwardBatch, cache: CacheTensors | None, layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last hidden states [T, D], the hidden states entering `layers` side by side [T, len(layers) * D]): what an
        EAGLE-3 draft reads (K3Model.forward_with_aux says which tensor)."""
        h, aux = self.model.forward_with_aux(batch, cache, layers)
        return h, torch.cat(aux, dim=-1)

    def compute_logits(self, h_MD: torch.Tensor) -> torch.Tensor:
        """Logits [M, V] of hidden rows from hidden_states."""
        return self.lm_head(h_MD)

    def forward_tokens(self, input_ids_BL: torch.Tensor) -> torch.Tensor:
        """Cache-free forward of equal-length sequences: logits [B, L, V] (reference checks; training selects the
        differentiable KDA first: select_ops(target=OpTarget(training=True)))."""
        b, seq_len = input_ids_BL.shape
        return self.forward(ForwardBatch.from_tokens(input_ids_BL)).view(b, seq_len, -1)

    def select_ops(self, ops: OpChoice | None = None, target: OpTarget = CPU_INFERENCE) -> None:
        """Choose every layer's implementations by name (ops/registry.py), "auto" resolved for `target` (its device, and
        whether it trains); the parameters are untouched. Training calls it with OpTarget(training=True), the serving
        runner with the device it serves on."""
        previous, self.ops = self.ops, ops or self.ops
        select_block_ops(self, self.ops, target, previous.moe)
        self.model.select_depth_stream(self.ops.attn_res, target)
        if self.vision is not None:
            self.vision_tower.select(self.ops.vision_attn, target)

    def set_expert_backend(self, backend: ExpertBackend) -> None:
        """Attach expert parallelism (or any other expert execution) from outside: the MoE layers' only seam."""
        for moe in self.moe_layers():
            moe.backend = backend

    def quantize_experts(self) -> None:
        """Replace every dense routed-expert bank by its packed MXFP4 encoding (OCP MX, FLOOR scales), in place."""
        for moe in self.moe_layers():
            if isinstance(moe.experts, DenseExperts):
                moe.experts = PackedExperts.from_dense(moe.experts)

    def moe_layers(self) -> list[LatentMoE]:
        return [layer.block_sparse_moe for layer in self.model.layers if layer.is_moe]

    @torch.no_grad()
    def init_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Deterministic random init (spec conventions): normal(0, std) matrices, unit norms, zero AttnRes queries and router
        bias, KDA gate parameters as in the KDA paper. Used for tests and as the trainer's starting point."""
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("_res_proj.weight"):
                p.zero_()
            elif "norm" in name.rsplit(".", 2)[-2] or leaf in ("A_log", "dt_bias"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(std).to(p.dtype))
        for layer in self.model.layers:
            if isinstance(layer.self_attn, KimiDeltaAttention):
                layer.self_attn.reset_gate_parameters(g)
        for moe in self.moe_layers():
            moe.gate.e_score_correction_bias.zero_()

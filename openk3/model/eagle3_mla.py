"""Eagle3MLAHead: the EAGLE-3 draft head with one K3 gated-MLA decoder layer (NoPE), the layout of the K3 drafts.

Legend: T packed rows, H head hidden, Ht target hidden, A aux layers (3), Hn heads, Dn/Dr/Dv qk_nope/qk_rope/v head dims,
Lr kv_lora_rank, R = Lr + Dr, Vd draft vocabulary, V target vocabulary, P past positions of one sequence.
The EAGLE-3 part is the Llama head's (model/eagle3.py); the decoder layer is K3's own MLA layer read over the 2H input
(model/mla.py GatedMLA, built with input_size 2H), as NeMo Automodel's KimiK3Eagle3DraftModel defines it:

    g = fc([fc_norm_1(a_1) ; fc_norm_2(a_2) ; fc_norm_3(a_3)])      # fc_norm only where the config has fc_norm: true
    x2 = [input_layernorm(embed(t_{p+1})) ; hidden_norm(g)]          # [T, 2H]; a chained draft passes its own x for g
    x = g + o_proj(sigmoid(g_proj(x2)) * mla(x2))                    # gated MLA, NoPE: the k_pe slice rides unrotated
    x = x + mlp(post_attention_layernorm(x))                         # SiTU (K3's) or SiLU gate/up/down, as hidden_act says
    logits_d = lm_head(norm(x))                                      # [T, Vd]; draft id i is target id i + d2t[i]

NoPE: no rotation anywhere, so positions do not enter the forward (the argument is kept so the proposer drives both heads
alike). Each position's cache is its latent [c_kv (post-norm) | k_pe], R values, kept by the caller (serve/eagle3_draft.py)
as the two row tensors `Past.keys` (c_kv [P, Lr]) and `Past.values` (k_pe [P, Dr]). The softmax scale is qk_head_dim^-1/2,
times DeepSeek-V3's YaRN mscale^2 where the config carries a yarn rope_scaling (model/eagle3_mla_load.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from openk3.checks import check_int, fail
from openk3.config import Activation, MLAConfig, ModelConfig
from openk3.model.eagle3 import DraftVocabHead, Eagle3Head, Past
from openk3.model.layers import GatedMLP, RMSNorm
from openk3.model.mla import GatedMLA
from openk3.ops.mla import split_kv_b
from openk3.ops.registry import OpTarget


@dataclass(frozen=True)
class Eagle3MLAConfig:
    """The head's dimensions (config.json of a K3 EAGLE-3 MLA checkpoint: model/eagle3_mla_load.py reads it)."""

    hidden_size: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    mla: MLAConfig
    activation: Activation = Activation.SITU
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    rms_norm_eps: float = 1e-5
    softmax_scale: float | None = None  # None: qk_head_dim^-1/2
    fc_norm: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "intermediate_size", "vocab_size", "target_hidden_size"):
            check_int("Eagle3MLAConfig", name, getattr(self, name), low=1)
        check_int("Eagle3MLAConfig", "draft_vocab_size", self.draft_vocab_size, low=1, high=self.vocab_size)
        if len(self.aux_layer_ids) != 3:
            fail("Eagle3MLAConfig", "aux_layer_ids", self.aux_layer_ids, "three target layer ids (EAGLE-3 fuses three layers' hidden states)")

    def block(self, target: ModelConfig) -> ModelConfig:
        """A ModelConfig carrying the head's MLA dimensions and width, from which GatedMLA builds the layer."""
        return target.replace(hidden_size=self.hidden_size, mla=self.mla)


class Eagle3MLALayer(nn.Module):
    """`midlayer.*` (or `layers.0.*`): the norms, the gated MLA over 2H and the MLP."""

    def __init__(self, cfg: Eagle3MLAConfig, block: ModelConfig) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = GatedMLA(block, input_size=2 * h, norm_eps=eps)
        if cfg.softmax_scale is not None:
            self.self_attn.scale = cfg.softmax_scale
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size, cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)


class Eagle3MLAHead(DraftVocabHead):
    """An EAGLE-3 head whose layer is K3's NoPE gated MLA: the checkpoint's tensors by their names, `fc`, `fc_norm.{0,1,2}`
    (with fc_norm), `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, and `embed_tokens` where it ships one (DraftVocabHead)."""

    midlayer: Eagle3MLALayer

    def __init__(self, cfg: Eagle3MLAConfig, target_config: ModelConfig, target_embed: nn.Embedding | None, own_embedding: bool = False) -> None:
        super().__init__(cfg, Eagle3MLALayer(cfg, cfg.block(target_config)), target_embed, own_embedding)
        self.config = cfg
        a = len(cfg.aux_layer_ids)
        self.fc_norm = nn.ModuleList([RMSNorm(cfg.target_hidden_size, cfg.rms_norm_eps) for _ in range(a)]) if cfg.fc_norm else None

    def cache_rows(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of one position's two cached rows: c_kv [Lr] and k_pe [Dr] (the Llama head's: keys and values)."""
        return (self.config.mla.kv_lora_rank,), (self.config.mla.qk_rope_head_dim,)

    def fuse(self, aux_TAH: torch.Tensor) -> torch.Tensor:
        """g = fc(the target's aux hidden states side by side, each normed first with fc_norm) [T, H]."""
        aux = aux_TAH.to(self.fc.weight.dtype)
        if self.fc_norm is not None:
            aux = torch.cat([norm(part) for norm, part in zip(self.fc_norm, aux.chunk(len(self.fc_norm), -1), strict=True)], -1)
        return self.fc(aux)

    def forward(
        self, input_ids_T: torch.Tensor, hidden_TH: torch.Tensor, positions_T: torch.Tensor, seqs: Sequence[Past]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x [T, H], the rows' c_kv [T, Lr] and k_pe [T, Dr] to keep): the layer over packed rows of several sequences,
        each attending causally over its Past (c_kv in `keys`, k_pe in `values`) and its own rows. NoPE: positions unused."""
        layer = self.midlayer
        attn = layer.self_attn
        x2 = torch.cat([layer.input_layernorm(self.embed(input_ids_T).to(hidden_TH.dtype)), layer.hidden_norm(hidden_TH)], -1)
        inp = attn.project(x2)
        c, kpe = inp.latent_TR.split([attn.lora, attn.rope], dim=-1)
        w_uk, w_uv = split_kv_b(attn.kv_b_proj.weight, attn.num_heads, attn.nope, attn.v_dim)
        parts = []
        for s in seqs:
            c_all = torch.cat([s.keys.to(c.dtype), c[s.start : s.end]])
            kpe_all = torch.cat([s.values.to(kpe.dtype), kpe[s.start : s.end]])
            parts.append(attn.prefill(inp.q_nope[s.start : s.end], inp.q_pe[s.start : s.end], c_all, kpe_all, w_uk, w_uv, attn.scale, len(s.keys)))
        x = hidden_TH + attn.output(torch.cat(parts), inp.gate_logits, x2.dtype)
        return x + layer.mlp(layer.post_attention_layernorm(x)), c, kpe

    def select_ops(self, target: OpTarget) -> None:
        """Choose the norms', projections', MLP activation's and the MLA attention's implementations for what runs now."""
        super().select_ops(target)
        for module in self.modules():
            if isinstance(module, GatedMLA):
                module.select("auto", target)


AnyEagle3Head = Eagle3Head | Eagle3MLAHead  # what the proposer, the engine and the loaders take

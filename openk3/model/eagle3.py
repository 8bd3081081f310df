"""Eagle3Head: the EAGLE-3 draft head (arXiv 2503.01840) in the layout published heads ship and vLLM's llama_eagle3 reads.

Legend: T packed rows, H head hidden, Ht target hidden, A aux layers (3), N query heads, G key/value heads, d head dim,
Vd draft vocabulary, V target vocabulary, P past positions of one sequence.
At position p the head reads the target's hidden states at p from A layers (model.py K3Model.forward_with_aux says which
tensor) and the embedding of the token after p, and predicts the token after that:

    g = fc([a_1 ; a_2 ; a_3])                                   # [T, A*Ht] -> [T, H]  (a chained draft passes x instead)
    r = g  (or hidden_norm(g) with norm_before_residual)
    x = r + o_proj(attention(q/k/v([input_layernorm(embed(t_{p+1})) ; hidden_norm(g)])))     # q/k/v read 2H
    x = x + mlp(post_attention_layernorm(x))                    # SwiGLU gate/up/down
    logits_d = lm_head(norm(x))                                 # [T, Vd]; draft id i is target id i + d2t[i]

Attention is GQA with RoPE (rotate-half, as Llama) at the row's position, over the head's own keys and values of the
sequence's earlier positions (the caller keeps them: serve/eagle3_draft.py) and the rows' own, causally. For k > 1 drafts
the head runs again one position on, reading its own pre-norm output x in place of g (as EAGLE-3 and vLLM chain it).
`embed_tokens` is the head's own where the checkpoint ships one, else the target's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from openk3.checks import check_int, fail
from openk3.config import Activation
from openk3.model.layers import GatedMLP, Linear, RMSNorm
from openk3.ops.registry import OpTarget


@dataclass(frozen=True)
class Eagle3Config:
    """The head's dimensions (config.json of an EAGLE-3 checkpoint: model/eagle3_load.py reads it)."""

    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (what d2t maps into)
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_llama3: tuple[float, float, float, int] | None = None  # (factor, low_freq_factor, high_freq_factor, original max positions)
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "target_hidden_size"):
            check_int("Eagle3Config", name, getattr(self, name), low=1)
        check_int("Eagle3Config", "draft_vocab_size", self.draft_vocab_size, low=1, high=self.vocab_size)
        if self.num_attention_heads % self.num_key_value_heads:
            fail("Eagle3Config", "num_key_value_heads", self.num_key_value_heads, f"a divisor of num_attention_heads={self.num_attention_heads}")
        if len(self.aux_layer_ids) != 3:
            fail("Eagle3Config", "aux_layer_ids", self.aux_layer_ids, "three target layer ids (EAGLE-3 fuses three layers' hidden states)")
        if self.head_dim % 2:
            fail("Eagle3Config", "head_dim", self.head_dim, "an even number (RoPE rotates pairs)")


class Past(NamedTuple):
    """One sequence's rows of a step: rows [start, end) of the packed batch, after `keys`/`values` [P, G, d] of its
    earlier positions (already rotated), which every row attends to before its own sequence's rows up to itself. The K3
    MLA head (model/eagle3_mla.py) passes its latent halves the same way: c_kv [P, Lr] as `keys`, k_pe [P, Dr] as `values`."""

    start: int
    end: int
    keys: torch.Tensor
    values: torch.Tensor


def rope_frequencies(cfg: Eagle3Config) -> torch.Tensor:
    """Inverse frequencies [d / 2] (Llama's, with Llama 3.1's long-context rescaling where the config asks for it)."""
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    if cfg.rope_llama3 is None:
        return inv.float()
    factor, low, high, original = cfg.rope_llama3
    wavelen = 2 * math.pi / inv
    smooth = ((original / wavelen) - low) / (high - low)
    scaled = torch.where(wavelen > original / low, inv / factor, inv)
    mid = (wavelen <= original / low) & (wavelen >= original / high)
    return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled).float()


def rotate(x_TND: torch.Tensor, positions_T: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """RoPE in Llama's rotate-half layout: dims i and i + d/2 form a pair."""
    angles = positions_T.to(torch.float32)[:, None] * inv_freq.to(positions_T.device)[None]  # [T, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None].to(x_TND.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None].to(x_TND.dtype)
    half = x_TND.shape[-1] // 2
    rotated = torch.cat([-x_TND[..., half:], x_TND[..., :half]], -1)
    return x_TND * cos + rotated * sin


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        n, g, d, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.q_proj = Linear(2 * h, n * d, bias=False)
        self.k_proj = Linear(2 * h, g * d, bias=False)
        self.v_proj = Linear(2 * h, g * d, bias=False)
        self.o_proj = Linear(n * d, h, bias=False)
        self.shape = (n, g, d)

    def qkv(self, x_T2H: torch.Tensor, positions_T: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated queries [T, N, d], rotated keys and values [T, G, d]."""
        n, g, d = self.shape
        t = x_T2H.shape[0]
        q = rotate(self.q_proj(x_T2H).view(t, n, d), positions_T, inv_freq)
        k = rotate(self.k_proj(x_T2H).view(t, g, d), positions_T, inv_freq)
        return q, k, self.v_proj(x_T2H).view(t, g, d)


def attend(q_TND: torch.Tensor, k_SGD: torch.Tensor, v_SGD: torch.Tensor, past: int) -> torch.Tensor:
    """Causal GQA attention of T query rows over S = past + T keys (row i sees keys 0 .. past + i): [T, N * d]."""
    t, n, d = q_TND.shape
    mask = None if t == 1 else torch.ones(t, past + t, dtype=torch.bool, device=q_TND.device).tril(past)  # one row sees all
    out = F.scaled_dot_product_attention(q_TND.transpose(0, 1), k_SGD.transpose(0, 1), v_SGD.transpose(0, 1), attn_mask=mask, enable_gqa=True)
    return out.transpose(0, 1).reshape(t, n * d)


class Eagle3Layer(nn.Module):
    """`midlayer.*`: the one decoder layer."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.hidden_norm = RMSNorm(h, eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size, Activation.SILU)


class HeadDims(Protocol):
    """What every EAGLE-3 head's config gives the parts all heads share (Eagle3Config; model/eagle3_mla.py's Eagle3MLAConfig)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def draft_vocab_size(self) -> int: ...
    @property
    def target_hidden_size(self) -> int: ...
    @property
    def aux_layer_ids(self) -> tuple[int, ...]: ...
    @property
    def rms_norm_eps(self) -> float: ...


class DraftVocabHead(nn.Module):
    """The parts of an EAGLE-3 head that do not depend on its decoder layer (a Llama layer here, K3's gated MLA in
    model/eagle3_mla.py): `fc` over the target's aux hidden states, the final `norm`, `lm_head` over the draft vocabulary,
    `d2t` (draft id -> target id offset) and `t2d` (which target ids the draft vocabulary holds), and the embedding --
    `embed_tokens` where the checkpoint ships one, else the target's, held but not registered. The decoder layer itself
    (`midlayer`) is the subclass's."""

    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, cfg: HeadDims, midlayer: nn.Module, target_embed: nn.Embedding | None, own_embedding: bool) -> None:
        super().__init__()
        name = type(self).__name__
        if target_embed is None and not own_embedding:
            raise ValueError(f"{name}: a head without its own embed_tokens reads the target's embedding; none was given")
        if not own_embedding and target_embed is not None and target_embed.embedding_dim != cfg.hidden_size:
            raise ValueError(
                f"{name}: hidden_size={cfg.hidden_size} differs from the target's embedding width {target_embed.embedding_dim}: the head must ship embed_tokens"
            )
        h = cfg.hidden_size
        self.fc = Linear(len(cfg.aux_layer_ids) * cfg.target_hidden_size, h, bias=False)
        self.midlayer = midlayer  # registered before norm and lm_head, as the checkpoints list them (and seeded inits draw)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = Linear(h, cfg.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if own_embedding else None
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.full((cfg.vocab_size,), cfg.draft_vocab_size == cfg.vocab_size, dtype=torch.bool))
        self.target_parts: tuple[nn.Embedding, ...] = () if target_embed is None else (target_embed,)  # a tuple: not registered here

    def embed(self, input_ids_T: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self.target_parts[0])(input_ids_T)

    def draft_logits(self, x_MH: torch.Tensor) -> torch.Tensor:
        """Logits [M, Vd] over the draft vocabulary (draft id i is target id i + d2t[i])."""
        return self.lm_head(self.norm(x_MH))

    def select_ops(self, target: OpTarget) -> None:
        """Choose the norms', projections' and MLP activation's implementations for what runs now (inference or training)."""
        for module in self.modules():
            if isinstance(module, (Linear, RMSNorm, GatedMLP)):
                module.select(target)

    def to_target(self, logits_MVd: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits spread over the target's vocabulary [M, V], -inf at the ids the draft cannot propose."""
        out = logits_MVd.new_full((logits_MVd.shape[0], len(self.t2d)), float("-inf"))  # t2d: one flag per target id
        out[:, torch.arange(len(self.d2t), device=out.device) + self.d2t] = logits_MVd
        return out

    def compute_logits(self, x_MH: torch.Tensor) -> torch.Tensor:
        """Logits [M, V] over the target's vocabulary: the draft vocabulary's at their target ids, -inf elsewhere."""
        return self.to_target(self.draft_logits(x_MH))


class Eagle3Head(DraftVocabHead):
    """An EAGLE-3 head whose layer is one Llama decoder layer: the checkpoint's tensors by their published names, `fc`,
    `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`, and `embed_tokens` where it ships one (DraftVocabHead)."""

    inv_freq: torch.Tensor
    midlayer: Eagle3Layer

    def __init__(self, cfg: Eagle3Config, target_embed: nn.Embedding | None, own_embedding: bool = False) -> None:
        super().__init__(cfg, Eagle3Layer(cfg), target_embed, own_embedding)
        self.config = cfg
        self.register_buffer("inv_freq", rope_frequencies(cfg), persistent=False)

    def cache_rows(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of one position's two cached rows: its rotated keys and its values, [G, d] each."""
        return (self.config.num_key_value_heads, self.config.head_dim), (self.config.num_key_value_heads, self.config.head_dim)

    def fuse(self, aux_TAH: torch.Tensor) -> torch.Tensor:
        """g = fc(the target's aux hidden states side by side) [T, H]."""
        return self.fc(aux_TAH.to(self.fc.weight.dtype))

    def layer_input(self, input_ids_T: torch.Tensor, hidden_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual the layer adds to, the 2H input of q/k/v) of rows reading token ids and g (or a chained x)."""
        layer = self.midlayer
        normed = layer.hidden_norm(hidden_TH)
        x2 = torch.cat([layer.input_layernorm(self.embed(input_ids_T).to(hidden_TH.dtype)), normed], -1)
        return (normed if self.config.norm_before_residual else hidden_TH), x2

    def finish(self, residual_TH: torch.Tensor, attn_TNd: torch.Tensor) -> torch.Tensor:
        """x: the layer's pre-norm output, from its residual and the attention rows [T, N*d]."""
        layer = self.midlayer
        x = residual_TH + layer.self_attn.o_proj(attn_TNd)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def forward(
        self, input_ids_T: torch.Tensor, hidden_TH: torch.Tensor, positions_T: torch.Tensor, seqs: Sequence[Past]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x [T, H], the rows' keys and values [T, G, d] to keep): the layer over packed rows of several sequences."""
        residual, x2 = self.layer_input(input_ids_T, hidden_TH)
        q, k, v = self.midlayer.self_attn.qkv(x2, positions_T, self.inv_freq)
        parts = []
        for s in seqs:
            keys = torch.cat([s.keys.to(k.dtype), k[s.start : s.end]])
            values = torch.cat([s.values.to(v.dtype), v[s.start : s.end]])
            parts.append(attend(q[s.start : s.end], keys, values, len(s.keys)))
        return self.finish(residual, torch.cat(parts)), k, v

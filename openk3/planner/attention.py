"""Attention as the planner prices it: MLA (one latent per token shared by all heads) or GQA/MHA (K and V per KV head).

`ModelConfig` describes K3's layer kinds (MLA and KDA). A GQA model such as Qwen3-MoE is planned as a `GQAModelConfig`:
the same dataclass with every full-attention layer described by `gqa` instead of `mla` (whose fields it then leaves
unread by the planner), and its own parameter count for those layers. Everything that differs between the two kinds
is in `AttentionShape`:

- cache per token per layer: MLA `kv_lora_rank + qk_rope_head_dim` values; GQA `2 x kv_heads x head_dim`;
- TP: an MLA latent is shared by all heads, so every TP rank holds all of it; GQA splits its KV heads over TP ranks
  (TP beyond the KV heads replicates them: each rank keeps one KV head's share);
- FLOPs per query per key: absorbed MLA decode scores over the latent and reads values from its 512-wide part
  (576 + 512 for K3); naive MLA prefill and GQA use qk + v head widths.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from openk3.checks import check_int
from openk3.config import LayerKind, ModelConfig


@dataclass(frozen=True)
class GQAConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head (head_dim weights each)

    def __post_init__(self) -> None:
        check_int("GQAConfig", "num_heads", self.num_heads, low=1)
        check_int("GQAConfig", "num_kv_heads", self.num_kv_heads, low=1, high=self.num_heads)
        check_int("GQAConfig", "head_dim", self.head_dim, low=1)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"GQAConfig.num_kv_heads={self.num_kv_heads} is invalid: expected a divisor of num_heads={self.num_heads}")


@dataclass(frozen=True)
class GQAModelConfig(ModelConfig):
    """A ModelConfig whose full-attention layers are GQA; `router_bias` False drops the selection bias ModelConfig counts."""

    gqa: GQAConfig | None = None
    router_bias: bool = True

    def mla_layer_params(self) -> int:
        if self.gqa is None:
            return super().mla_layer_params()
        d, g = self.hidden_size, self.gqa
        n = d * g.num_heads * g.head_dim + 2 * d * g.num_kv_heads * g.head_dim + g.num_heads * g.head_dim * d  # q, k, v, o
        return n + (2 * g.head_dim if g.qk_norm else 0)

    def moe_layer_fixed_params(self) -> int:
        return super().moe_layer_fixed_params() - (0 if self.router_bias else self.moe.num_experts)


@dataclass(frozen=True)
class AttentionShape:
    kind: str  # "mla" or "gqa"
    num_layers: int
    num_heads: int
    kv_heads: int | None  # GQA only
    cache_values_per_token_per_layer: int
    decode_width: int  # FLOPs per query per key = 2 x heads x this
    prefill_width: int

    def kv_split(self, tp: int) -> int:
        """How many ways TP divides the cache of one sequence: 1 for MLA (latent replicated), the KV heads' share for GQA."""
        return 1 if self.kv_heads is None else min(tp, self.kv_heads)

    @property
    def component(self) -> str:
        return "mla_attention" if self.kind == "mla" else "attention"


def gqa_of(config: ModelConfig) -> GQAConfig | None:
    return config.gqa if isinstance(config, GQAModelConfig) else None


@functools.lru_cache(maxsize=64)
def attention_shape(config: ModelConfig) -> AttentionShape:
    layers = config.layer_kinds.count(LayerKind.MLA)
    g = gqa_of(config)
    if g is not None:
        width = 2 * g.head_dim
        return AttentionShape("gqa", layers, g.num_heads, g.num_kv_heads, 2 * g.num_kv_heads * g.head_dim, width, width)
    m = config.mla
    return AttentionShape("mla", layers, m.num_heads, None, m.latent_dim, m.latent_dim + m.kv_lora_rank, m.qk_head_dim + m.v_head_dim)


def attention_tp_problem(config: ModelConfig, tp: int) -> str | None:
    """Why TP cannot split this model's attention: the query heads must divide evenly, and GQA's KV heads either divide
    over the ranks or are replicated a whole number of times."""
    shape = attention_shape(config)
    bad = []
    if shape.num_heads % tp:
        bad.append(f"{shape.num_heads} {'MLA' if shape.kind == 'mla' else 'attention'} heads")
    if shape.kv_heads is not None and shape.kv_heads % tp and tp % shape.kv_heads:
        bad.append(f"{shape.kv_heads} KV heads (nor is it a multiple of them)")
    if config.kda_layers and config.kda.num_heads % tp:
        bad.append(f"{config.kda.num_heads} KDA heads")
    if not bad:
        return None
    return f"tp={tp} does not divide {' and '.join(bad)}; TP must split the attention heads evenly"

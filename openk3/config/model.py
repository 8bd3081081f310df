"""Model configuration: one frozen dataclass that describes K3, Kimi-Linear and the small test/demo models.

Every optional K3 feature is a field whose "off" value gives Kimi-Linear back (no AttnRes, experts at full width,
softplus KDA gate, low-rank KDA output gate, no MLA output gate, SiLU). `param_count()` derives the parameter totals
from the fields alone, so the planner can reason about a 2.8T model without allocating it.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from openk3.checks import check_int, fail


class LayerKind(str, enum.Enum):
    KDA = "kda"
    MLA = "mla"


class KDAGate(str, enum.Enum):
    SOFTPLUS = "softplus"  # Kimi Linear: g = -exp(A) * softplus(f + dt_bias)
    LOWER_BOUND = "lower_bound"  # K3 "safe gate": g = lb * sigmoid(exp(A) * (f + dt_bias))


class Activation(str, enum.Enum):
    SILU = "silu"
    SITU = "situ"


@dataclass(frozen=True)
class KDAConfig:
    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    gate: KDAGate = KDAGate.SOFTPLUS
    gate_lower_bound: float | None = None
    full_rank_output_gate: bool = False

    def __post_init__(self) -> None:
        check_int("ModelConfig", "kda.num_heads", self.num_heads, low=1)
        check_int("ModelConfig", "kda.head_dim", self.head_dim, low=1)
        check_int("ModelConfig", "kda.conv_kernel", self.conv_kernel, low=1)
        if self.gate == KDAGate.LOWER_BOUND and (self.gate_lower_bound is None or self.gate_lower_bound >= 0):
            fail("ModelConfig", "kda.gate_lower_bound", self.gate_lower_bound, "a negative float when gate='lower_bound'")
        if self.gate == KDAGate.SOFTPLUS and self.gate_lower_bound is not None:
            fail("ModelConfig", "kda.gate_lower_bound", self.gate_lower_bound, "None when gate='softplus' (the bound belongs to the K3 gate)")

    @property
    def proj_dim(self) -> int:
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool = False

    def __post_init__(self) -> None:
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            check_int("ModelConfig", f"mla.{name}", getattr(self, name), low=1)
        if self.q_lora_rank is not None:
            check_int("ModelConfig", "mla.q_lora_rank", self.q_lora_rank, low=1)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached token per MLA layer: normalised c_kv plus the shared k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    num_experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int = 1
    latent_size: int | None = None  # routed_expert_hidden_size; None = experts at full width (Kimi Linear)
    latent_norm: bool = False
    routed_scaling_factor: float = 1.0
    renormalize: bool = True

    def __post_init__(self) -> None:
        check_int("ModelConfig", "moe.num_experts", self.num_experts, low=1)
        check_int("ModelConfig", "moe.moe_intermediate_size", self.moe_intermediate_size, low=1)
        if not 0 < self.num_experts_per_token <= self.num_experts:
            fail("ModelConfig", "moe.num_experts_per_token", self.num_experts_per_token, f"1..{self.num_experts}")
        if self.num_shared_experts < 0:
            fail("ModelConfig", "moe.num_shared_experts", self.num_shared_experts, ">= 0")
        if self.latent_size is not None:
            check_int("ModelConfig", "moe.latent_size", self.latent_size, low=1)
        if self.latent_norm and self.latent_size is None:
            fail("ModelConfig", "moe.latent_norm", True, "False when latent_size is None")


class ParamCount(NamedTuple):
    total: int
    active: int  # per token: input embedding excluded, lm_head included, top-k routed experts only


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    mla_layers: tuple[int, ...]  # 0-based indices of the gated-MLA layers; every other layer is KDA
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    intermediate_size: int  # dense MLP of the first `first_k_dense_replace` layers
    first_k_dense_replace: int = 1
    hidden_act: Activation = Activation.SILU
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    attn_res_block_size: int | None = None  # decoder layers per AttnRes block; None = plain residuals
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    expert_quantization: str | None = None  # "mxfp4" for K3's packed routed experts
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        check_int("ModelConfig", "vocab_size", self.vocab_size, low=1)
        check_int("ModelConfig", "hidden_size", self.hidden_size, low=1)
        check_int("ModelConfig", "num_hidden_layers", self.num_hidden_layers, low=1)
        check_int("ModelConfig", "intermediate_size", self.intermediate_size, low=1)
        if any(not 0 <= i < self.num_hidden_layers for i in self.mla_layers) or len(set(self.mla_layers)) != len(self.mla_layers):
            fail("ModelConfig", "mla_layers", self.mla_layers, f"distinct layer indices in 0..{self.num_hidden_layers - 1}")
        if tuple(sorted(self.mla_layers)) != tuple(self.mla_layers):
            fail("ModelConfig", "mla_layers", self.mla_layers, "sorted ascending")
        if not 0 <= self.first_k_dense_replace <= self.num_hidden_layers:
            fail("ModelConfig", "first_k_dense_replace", self.first_k_dense_replace, f"0..{self.num_hidden_layers}")
        if self.attn_res_block_size is not None:
            check_int("ModelConfig", "attn_res_block_size", self.attn_res_block_size, low=1)
        if not self.rms_norm_eps > 0:
            fail("ModelConfig", "rms_norm_eps", self.rms_norm_eps, "> 0")
        if self.expert_quantization not in (None, "mxfp4"):
            fail("ModelConfig", "expert_quantization", self.expert_quantization, "None or 'mxfp4'")
        if self.expert_quantization == "mxfp4":
            width = self.moe.latent_size or self.hidden_size
            for dim_name, dim in (("expert input width", width), ("moe_intermediate_size", self.moe.moe_intermediate_size)):
                if dim % 32:
                    fail("ModelConfig", "expert_quantization", "mxfp4", f"{dim_name} ({dim}) to be a multiple of 32")

    # ---- layer schedule ------------------------------------------------------------------------------------------

    def layer_kind(self, i: int) -> LayerKind:
        return LayerKind.MLA if i in self.mla_layers else LayerKind.KDA

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_hidden_layers))

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if i not in self.mla_layers)

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    # ---- parameter accounting (no allocation) --------------------------------------------------------------------

    def kda_layer_params(self) -> int:
        d, k = self.hidden_size, self.kda
        p = k.proj_dim
        n = 3 * p * d  # q, k, v
        n += 3 * p * k.conv_kernel  # depthwise short convs, no bias
        n += k.head_dim * d + p * k.head_dim  # forget gate low rank f_a, f_b
        n += k.num_heads + p  # A_log, dt_bias
        n += k.num_heads * d  # b_proj
        n += p * d if k.full_rank_output_gate else k.head_dim * d + p * k.head_dim  # output gate
        n += k.head_dim  # o_norm
        n += d * p  # o_proj
        return n

    def mla_layer_params(self) -> int:
        d, m = self.hidden_size, self.mla
        h = m.num_heads
        if m.q_lora_rank is None:
            n = h * m.qk_head_dim * d
        else:
            n = m.q_lora_rank * d + m.q_lora_rank + h * m.qk_head_dim * m.q_lora_rank
        n += m.latent_dim * d + m.kv_lora_rank
        n += h * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank
        if m.output_gate:
            n += h * m.v_head_dim * d
        n += d * h * m.v_head_dim
        return n

    def routed_expert_params(self) -> int:
        width = self.moe.latent_size or self.hidden_size
        return 3 * width * self.moe.moe_intermediate_size

    def moe_layer_fixed_params(self) -> int:
        """Everything in an MoE layer except the routed experts: router, shared experts, latent projections."""
        d, e = self.hidden_size, self.moe
        n = e.num_experts * d + e.num_experts  # router weight + selection bias
        n += 3 * d * e.moe_intermediate_size * e.num_shared_experts
        if e.latent_size is not None:
            n += 2 * d * e.latent_size + (e.latent_size if e.latent_norm else 0)
        return n

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    def attn_res_params_per_layer(self) -> int:
        return 0 if self.attn_res_block_size is None else 4 * self.hidden_size

    def param_count(self) -> ParamCount:
        d = self.hidden_size
        per_layer_common = 2 * d + self.attn_res_params_per_layer()  # two RMSNorms + AttnRes queries and norms
        total = active = 0
        for i in range(self.num_hidden_layers):
            mixer = self.mla_layer_params() if self.layer_kind(i) == LayerKind.MLA else self.kda_layer_params()
            total += mixer + per_layer_common
            active += mixer + per_layer_common
            if self.is_moe_layer(i):
                fixed = self.moe_layer_fixed_params()
                total += fixed + self.moe.num_experts * self.routed_expert_params()
                active += fixed + self.moe.num_experts_per_token * self.routed_expert_params()
            else:
                total += self.dense_mlp_params()
                active += self.dense_mlp_params()
        tail = d + (0 if self.attn_res_block_size is None else 2 * d)  # final norm + output AttnRes mixer
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        embed = self.vocab_size * d
        total += tail + head + embed
        active += tail + (head if head else embed)
        return ParamCount(total=total, active=active)

"""What the user decides: quantisation, parallel layout and workload. Frozen, validated, named by field on error."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from openk3.checks import fail

PRECISIONS = ("fp4", "fp8", "bf16")


@dataclass(frozen=True)
class Quantisation:
    """Storage bits per weight and the GEMM precision that runs them.

    MXFP4 is 4 bits plus one E8M0 scale byte per 32 values = 4.25 bits; NVFP4 4.5 bits plus 4 bytes per tensor
    (`expert_tensor_scale_bytes`, counted per routed-expert tensor). FP8 block scaling (one fp32 per 128 x 128) adds
    0.002 bits, ignored. The dispatch payload is FP8 plus one 8-bit scale per 32 (K3, 8.25 bits), which is also
    DeepEP's FP8 with one fp32 scale per 128 (8.25 bits); combine returns bf16. The KV cache (MLA latent or GQA K/V) and
    the KDA conv windows take `cache_dtype_bytes`; the KDA recurrent state `state_dtype_bytes` (fp32 as the engine keeps
    it). `expert_format` / `trunk_format` only name the formats for the report (`dtypes.py` sets them with the bits).
    """

    expert_bits: float = 4.25
    trunk_bits: float = 16.0
    expert_compute: str = "fp8"
    trunk_compute: str = "bf16"
    attention_compute: str = "bf16"
    cache_dtype_bytes: int = 2
    dispatch_bits: float = 8.25
    combine_bits: float = 16.0
    state_dtype_bytes: int = 4
    expert_tensor_scale_bytes: float = 0.0
    expert_format: str = "mxfp4"
    trunk_format: str = "bf16"

    def __post_init__(self) -> None:
        for name in ("expert_bits", "trunk_bits", "dispatch_bits", "combine_bits"):
            if not 0 < getattr(self, name) <= 32:
                fail("Quantisation", name, getattr(self, name), "bits per value in (0, 32]")
        for name in ("expert_compute", "trunk_compute", "attention_compute"):
            if getattr(self, name) not in PRECISIONS:
                fail("Quantisation", name, getattr(self, name), f"one of {PRECISIONS}")
        if self.cache_dtype_bytes not in (1, 2, 4):
            fail("Quantisation", "cache_dtype_bytes", self.cache_dtype_bytes, "1, 2 or 4")
        if self.state_dtype_bytes not in (2, 4):
            fail("Quantisation", "state_dtype_bytes", self.state_dtype_bytes, "2 (bf16) or 4 (fp32)")
        if self.expert_tensor_scale_bytes < 0:
            fail("Quantisation", "expert_tensor_scale_bytes", self.expert_tensor_scale_bytes, ">= 0 bytes per tensor")

    @classmethod
    def named(cls, name: str) -> Quantisation:
        presets = {
            "mxfp4": cls(),  # K3 as released: MXFP4 routed experts, bf16 everything else
            "mxfp4-fp8": cls(trunk_bits=8.0, trunk_compute="fp8", trunk_format="fp8"),
            "mxfp4-w4a4": cls(expert_compute="fp4"),
            "fp8": cls(expert_bits=8.0, trunk_bits=8.0, trunk_compute="fp8", expert_format="fp8", trunk_format="fp8"),  # DeepSeek-V3 / Kimi K2
            "bf16": cls(expert_bits=16.0, expert_compute="bf16", expert_format="bf16"),
        }
        try:
            return presets[name]
        except KeyError:
            raise ValueError(f"unknown quantisation {name!r}; choose one of {sorted(presets)}") from None


class Balance(str, enum.Enum):
    NONE = "none"  # experts placed once, routing skew lands on the ranks as it comes
    EPLB = "eplb"  # static replication + packing from measured loads (deepseek-ai/EPLB)
    MOONEP = "moonep"  # per-batch token shedding to fixed s*K slots, remote weights prefetched (MoonshotAI/MoonEP)


@dataclass(frozen=True)
class Layout:
    """How one serving instance spreads the model over `num_accelerators`.

    tp shards the trunk (attention, shared experts, dense MLP, embeddings) over tp ranks; tp=1 replicates it on every
    rank (data-parallel attention). Routed experts are spread over ep ranks; when ep < num_accelerators the expert
    set is replicated num_accelerators / ep times. The MLA latent cannot be split by head, so each TP rank holds the
    whole latent of its group's sequences; the KDA state splits by head.
    """

    num_accelerators: int
    tp: int = 1
    ep: int | None = None
    redundant_experts: int = 0
    balance: Balance = Balance.EPLB

    def __post_init__(self) -> None:
        if not isinstance(self.num_accelerators, int) or self.num_accelerators < 1:
            fail("Layout", "num_accelerators", self.num_accelerators, "a positive integer")
        if self.tp < 1 or self.num_accelerators % self.tp:
            fail("Layout", "tp", self.tp, f"a divisor of num_accelerators={self.num_accelerators}")
        if self.ep is not None and (self.ep < 1 or self.num_accelerators % self.ep):
            fail("Layout", "ep", self.ep, f"a divisor of num_accelerators={self.num_accelerators}")
        if self.redundant_experts < 0:
            fail("Layout", "redundant_experts", self.redundant_experts, ">= 0")
        object.__setattr__(self, "balance", Balance(self.balance))

    @property
    def ep_size(self) -> int:
        return self.num_accelerators if self.ep is None else self.ep

    @property
    def dp(self) -> int:
        """Attention data-parallel groups."""
        return self.num_accelerators // self.tp

    @property
    def replicated_trunk(self) -> bool:
        return self.tp == 1

    def describe(self) -> str:
        trunk = "DP-attn (trunk replicated)" if self.replicated_trunk else f"TP{self.tp} x DP{self.dp}"
        extra = f" +{self.redundant_experts} redundant" if self.redundant_experts else ""
        return f"{self.num_accelerators} acc, EP{self.ep_size}{extra}, {trunk}, {self.balance.value}"


@dataclass(frozen=True)
class Workload:
    """context: tokens cached per decoding sequence (its average over the decode); concurrency: sequences decoding at once
    in the instance; prompt: prefill length for TTFT (default = context); prefill_chunk: tokens per prefill step per group."""

    context: int
    concurrency: int
    prompt: int | None = None
    prefill_chunk: int = 8192

    def __post_init__(self) -> None:
        if self.context < 1:
            fail("Workload", "context", self.context, ">= 1 token")
        if self.concurrency < 0:
            fail("Workload", "concurrency", self.concurrency, ">= 0 sequences")
        if self.prompt is not None and self.prompt < 1:
            fail("Workload", "prompt", self.prompt, ">= 1 token or None")
        if self.prefill_chunk < 1:
            fail("Workload", "prefill_chunk", self.prefill_chunk, ">= 1 token")

    @property
    def prompt_tokens(self) -> int:
        return self.context if self.prompt is None else self.prompt


def parse_tokens(text: str) -> int:
    """'32k' -> 32768, '1m' -> 1048576, '2000' -> 2000 (binary k/M as context lengths are quoted)."""
    s = str(text).strip().lower()
    factor = 1
    if s.endswith("k"):
        factor, s = 1024, s[:-1]
    elif s.endswith("m"):
        factor, s = 1024 * 1024, s[:-1]
    try:
        value = float(s) * factor
    except ValueError:
        raise ValueError(f"token count {text!r} is invalid: expected a number with optional k/m suffix, e.g. 32k") from None
    if value < 1 or value != int(value):
        raise ValueError(f"token count {text!r} is invalid: expected a positive whole number of tokens")
    return int(value)

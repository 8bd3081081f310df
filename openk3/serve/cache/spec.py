"""Byte sizes of the hybrid cache: MLA latent pages and KDA state slots.

The engine sizes its pools from these numbers and the capacity planner plans HBM with them, so both agree by
construction (a planner test pins them together). Pure arithmetic on `ModelConfig`: no torch, no allocation.

Why the two kinds differ: an MLA layer caches one latent (kv_lora_rank + qk_rope_head_dim values) per token, so its
cost grows with context and is paged; a KDA layer keeps a fixed per-sequence recurrent state (H x K x V, fp32 because
it accumulates over the whole sequence) plus the last W-1 inputs of its three short convolutions (q, k, v).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from openk3.checks import check_int, fail
from openk3.config import ModelConfig
from openk3.config.cache_format import fp8_latent_width

FP32_BYTES = 4


@dataclass(frozen=True)
class MLAPageSpec:
    """One page holds `page_size` tokens of latent for every MLA layer."""

    num_layers: int
    latent_dim: int
    page_size: int
    dtype_bytes: int = 2
    scale_bytes: int = 0  # per token per layer: an FP8 cache's scales, stored beside the values (ops/mla/fp8_latent.py)

    def __post_init__(self) -> None:
        if self.num_layers < 0:
            fail("MLAPageSpec", "num_layers", self.num_layers, ">= 0")
        if self.scale_bytes < 0:
            fail("MLAPageSpec", "scale_bytes", self.scale_bytes, ">= 0")
        for name in ("latent_dim", "page_size", "dtype_bytes"):
            check_int("MLAPageSpec", name, getattr(self, name), low=1)

    @property
    def bytes_per_token_per_layer(self) -> int:
        return self.latent_dim * self.dtype_bytes + self.scale_bytes

    @property
    def bytes_per_token(self) -> int:
        """All MLA layers together: K3 24 x 576 x 2 = 27,648 B."""
        return self.bytes_per_token_per_layer * self.num_layers

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"MLAPageSpec.pages_for: num_tokens={num_tokens} is invalid: expected >= 0")
        return math.ceil(num_tokens / self.page_size)


@dataclass(frozen=True)
class KDAStateSpec:
    """One state slot: the recurrent state and the short-conv windows of every KDA layer of one sequence."""

    num_layers: int
    num_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    conv_dtype_bytes: int = 2
    state_dtype_bytes: int = FP32_BYTES

    def __post_init__(self) -> None:
        if self.num_layers < 0:
            fail("KDAStateSpec", "num_layers", self.num_layers, ">= 0")
        for name in ("num_heads", "head_k_dim", "head_v_dim", "conv_kernel", "conv_dtype_bytes", "state_dtype_bytes"):
            check_int("KDAStateSpec", name, getattr(self, name), low=1)

    @property
    def proj_dim(self) -> int:
        return self.num_heads * self.head_k_dim

    @property
    def recurrent_bytes_per_layer(self) -> int:
        return self.num_heads * self.head_k_dim * self.head_v_dim * self.state_dtype_bytes

    @property
    def conv_bytes_per_layer(self) -> int:
        """q, k and v each keep their last W-1 projected inputs."""
        return 3 * self.proj_dim * (self.conv_kernel - 1) * self.conv_dtype_bytes

    @property
    def recurrent_bytes(self) -> int:
        return self.recurrent_bytes_per_layer * self.num_layers

    @property
    def conv_bytes(self) -> int:
        return self.conv_bytes_per_layer * self.num_layers

    @property
    def bytes_per_sequence(self) -> int:
        return self.recurrent_bytes + self.conv_bytes


@dataclass(frozen=True)
class CacheSpec:
    mla: MLAPageSpec
    kda: KDAStateSpec

    @classmethod
    def from_config(cls, config: ModelConfig, page_size: int, cache_dtype_bytes: int = 2, fp8_latent: bool = False) -> CacheSpec:
        """Cache sizes of `config`; the MLA latent and the conv windows use the cache dtype, the KDA state fp32. With
        `fp8_latent` the MLA latent is one byte a value plus its scales (ops/mla/fp8_latent.py)."""
        num_mla = len(config.mla_layers)
        r = config.mla.latent_dim
        mla = MLAPageSpec(
            num_layers=num_mla,
            latent_dim=r,
            page_size=page_size,
            dtype_bytes=1 if fp8_latent else cache_dtype_bytes,
            scale_bytes=fp8_latent_width(r) - r if fp8_latent else 0,
        )
        kda = KDAStateSpec(
            num_layers=config.num_hidden_layers - num_mla,
            num_heads=config.kda.num_heads,
            head_k_dim=config.kda.head_dim,
            head_v_dim=config.kda.head_dim,
            conv_kernel=config.kda.conv_kernel,
            conv_dtype_bytes=cache_dtype_bytes,
        )
        return cls(mla=mla, kda=kda)

    def sequence_bytes(self, num_tokens: int) -> int:
        """Token-exact bytes of one sequence of `num_tokens` (its MLA latent plus one KDA state slot)."""
        if num_tokens < 0:
            raise ValueError(f"CacheSpec.sequence_bytes: num_tokens={num_tokens} is invalid: expected >= 0")
        return num_tokens * self.mla.bytes_per_token + self.kda.bytes_per_sequence

    def sequence_bytes_paged(self, num_tokens: int) -> int:
        """Bytes the engine actually holds for one sequence: whole pages plus one state slot."""
        return self.mla.pages_for(num_tokens) * self.mla.bytes_per_page + self.kda.bytes_per_sequence

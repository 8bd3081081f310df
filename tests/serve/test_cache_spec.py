"""Cache byte sizes: the K3 numbers of shared/spec/model.md section 1, and the small presets computed by hand."""

from __future__ import annotations

import pytest

from openk3.config import debug, k3, kimi_linear_48b
from openk3.serve.cache.spec import CacheSpec, KDAStateSpec, MLAPageSpec


def test_k3_mla_latent_is_27648_bytes_per_token() -> None:
    spec = CacheSpec.from_config(k3(), page_size=64)
    assert spec.mla.num_layers == 24
    assert spec.mla.bytes_per_token_per_layer == (512 + 64) * 2
    assert spec.mla.bytes_per_token == 27_648
    assert spec.mla.bytes_per_page == 27_648 * 64


def test_k3_kda_state_is_434_mb_plus_conv_windows() -> None:
    spec = CacheSpec.from_config(k3(), page_size=64)
    assert spec.kda.num_layers == 69
    assert spec.kda.recurrent_bytes == 69 * 96 * 128 * 128 * 4 == 434_110_464
    # 3 convs (q, k, v) x 12288 channels x 3 kept inputs x 2 bytes x 69 layers
    assert spec.kda.conv_bytes == 69 * 3 * 12288 * 3 * 2 == 15_261_696
    assert spec.kda.bytes_per_sequence == 434_110_464 + 15_261_696
    fp32_conv = CacheSpec.from_config(k3(), page_size=64, cache_dtype_bytes=4)
    assert fp32_conv.kda.conv_bytes == 30_523_392  # the spec's "~30 MB conv" is the fp32 window
    assert fp32_conv.mla.bytes_per_token == 55_296


def test_k3_one_million_token_sequence() -> None:
    spec = CacheSpec.from_config(k3(), page_size=64)
    assert spec.sequence_bytes(1_000_000) == 27_648_000_000 + 449_372_160
    assert spec.sequence_bytes_paged(1_000_000) == spec.sequence_bytes(1_000_000)  # 1M is a multiple of 64
    assert spec.sequence_bytes_paged(65) == 2 * 64 * 27_648 + 449_372_160


def test_kimi_linear_and_debug_by_hand() -> None:
    kl = CacheSpec.from_config(kimi_linear_48b(), page_size=16)
    assert kl.mla.bytes_per_token == 7 * 576 * 2
    assert kl.kda.recurrent_bytes == 20 * 32 * 128 * 128 * 4
    d = CacheSpec.from_config(debug(), page_size=4)
    assert (d.mla.num_layers, d.kda.num_layers) == (2, 3)  # layers 3 and 4 are MLA
    assert d.mla.bytes_per_token == 2 * (32 + 8) * 2
    assert d.kda.bytes_per_sequence == 3 * (2 * 16 * 16 * 4 + 3 * 32 * 3 * 2)
    assert d.mla.pages_for(0) == 0 and d.mla.pages_for(4) == 1 and d.mla.pages_for(5) == 2


def test_bad_values_name_the_field() -> None:
    with pytest.raises(ValueError, match="MLAPageSpec.page_size=0"):
        MLAPageSpec(num_layers=1, latent_dim=8, page_size=0)
    with pytest.raises(ValueError, match="KDAStateSpec.conv_kernel"):
        KDAStateSpec(num_layers=1, num_heads=1, head_k_dim=4, head_v_dim=4, conv_kernel=0)
    with pytest.raises(ValueError, match="num_tokens=-1"):
        CacheSpec.from_config(debug(), page_size=4).sequence_bytes(-1)

"""The FP8 latent row format (ops/mla/fp8_latent.py): e4m3 values with an fp32 scale per 64 channels, packed in one row."""

from __future__ import annotations

import pytest
import torch

from openk3.config.cache_format import FP8_GROUP, fp8_groups, fp8_latent_width
from openk3.ops.mla.fp8_latent import E4M3_MAX, pack_fp8_latent, unpack_fp8_latent


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [48, 64, 96, 576])
def test_round_trip_within_e4m3s_rounding(width: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(33, width, generator=g) * torch.logspace(-3, 2, 33).unsqueeze(1)).to(dtype)
    x[5] = 0
    packed = pack_fp8_latent(x)
    assert packed.dtype == torch.uint8 and packed.shape == (33, fp8_latent_width(width)) == (33, width + 4 * fp8_groups(width))
    back = unpack_fp8_latent(packed.view(3, 11, -1), width, torch.float32).view(33, width)
    ref = x.float()
    groups = torch.nn.functional.pad(ref.abs(), (0, fp8_groups(width) * FP8_GROUP - width)).view(33, -1, FP8_GROUP)
    scale = (groups.amax(-1) / E4M3_MAX).repeat_interleave(FP8_GROUP, dim=1)[:, :width]
    # e4m3: 3 mantissa bits (half an ulp is 2^-4 of the value), subnormals spaced 2^-9 of the scale
    assert torch.all((back - ref).abs() <= ref.abs() * 2**-4 + scale * 2**-9 + 1e-12)
    assert torch.equal(back[5], torch.zeros(width))
    torch.testing.assert_close(back.abs().amax(1), ref.abs().amax(1), rtol=1e-6, atol=0)  # a row's largest value: exact but for fp32


def test_unpacking_gives_the_asked_dtype() -> None:
    x = torch.randn(4, 96)
    assert unpack_fp8_latent(pack_fp8_latent(x), 96, torch.bfloat16).dtype == torch.bfloat16

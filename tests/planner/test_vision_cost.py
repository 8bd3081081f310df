"""The vision encoder's cost per image (planner/vision.py): FLOPs counted by hand for a tiny tower, the K3 tower's figures
for a 1024 x 1024 image, and a roofline time on an H100."""

from __future__ import annotations

import pytest

from openk3.config.vision import Projector, VisionConfig, VisionNorm
from openk3.planner.efficiency import Efficiency
from openk3.planner.hardware import load_catalogue
from openk3.planner.vision import vision_cost

K3 = VisionConfig(1024, 27, 12, 4096, 7168, qkv_hidden_size=1536, norm=VisionNorm.RMSNORM, projector=Projector.PATCHMERGER_V2)


def test_flops_of_a_tiny_tower_by_hand() -> None:
    v = VisionConfig(8, 1, 2, 16, 4, patch_size=2, pos_emb_height=2, pos_emb_width=2)
    c = vision_cost(v, (1, 2, 4))  # 8 patches, 2 merged tokens of k D = 32
    patch = 2 * 8 * 12 * 8  # 2 L (C P^2) D
    block = 2 * 8 * 8 * 24 + 2 * 8 * 8 * 8 + 4 * 8 * 8 * 16
    projector = 2 * 2 * 32 * 32 + 2 * 2 * 32 * 4
    assert c.gemm_flops == patch + block + projector
    assert c.attention_flops == 4 * 8 * 8 * 8
    assert c.num_tokens == 2
    assert c.weight_bytes == 2 * (12 * 8 + 2 * 2 * 8 + (8 * 24 + 8 * 8 + 2 * 8 * 16) + 32 * 32 + 32 * 4)


def test_the_k3_tower_on_one_image() -> None:
    c = vision_cost(K3, (1, 74, 74))  # a 1036 x 1036 image: 5476 patches, 1369 tokens
    assert c.num_tokens == 1369
    # 27 blocks x (2 L D 3Q + 2 L Q D + 4 L D I) = 27 x 160.8 GFLOP, + patch embedding 6.6 and projector 126 GFLOP
    assert c.gemm_flops == pytest.approx(4.474e12, rel=0.001)
    assert c.attention_flops == pytest.approx(27 * 4 * 5476**2 * 1536, rel=1e-12)
    h100 = load_catalogue().accelerators["h100-sxm"]
    seconds = c.seconds(h100, Efficiency())
    assert seconds == pytest.approx(4.474e12 / (989e12 * 0.5) + c.attention_flops / (989e12 * 0.3), rel=0.001)  # 9.0 + 16.8 ms
    assert c.weight_bytes / 2 == pytest.approx(446e6, rel=0.01)  # the tower and projector: ~0.45 B parameters


def test_bad_grids_are_named() -> None:
    with pytest.raises(ValueError, match="multiples of the merge kernel"):
        vision_cost(K3, (1, 3, 4))

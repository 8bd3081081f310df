"""The MoonViT3d tower and projector (openk3/model/vision*.py) against a CPU transcription of the release's modelling code
(tests/model/moonvit_reference.py), on random weights of odd sizes: hidden states and projector output to fp32 tolerance,
both attention forms, still images at and away from the position table's size, video chunks; and the release's
`vision_config` and tensor names."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.config.vision import Projector, VisionConfig, VisionNorm, vision_from_hf, vision_to_hf
from openk3.model.model import K3ForCausalLM, OpChoice
from openk3.model.vision_pos import Grid, rope_angles
from openk3.model.vision_projector import merged_tokens, tpool_merge
from tests.model.moonvit_reference import reference_forward, reference_from_vision_config

# the release's vision_config as published for KimiK3ForConditionalGeneration (27 layers, width 1024, attention 1536)
K3_VISION_CONFIG: dict[str, Any] = {
    "_attn_implementation": "flash_attention_2",
    "activation_func": "gelu_pytorch_tanh",
    "attn_bias": False,
    "init_pos_emb_height": 64,
    "init_pos_emb_time": 4,
    "init_pos_emb_width": 64,
    "linear_bias": False,
    "merge_kernel_size": [2, 2],
    "merge_type": "sd2_tpool",
    "mlp_type": "mlp2",
    "mm_hidden_size": 1024,
    "mm_projector_type": "patchmergerv2",
    "norm_type": "rmsnorm",
    "patch_embed_proj_bias": False,
    "patch_size": 14,
    "pos_emb_interpolation_mode": "bilinear",
    "pos_emb_type": "divided_fixed",
    "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-05,
    "qkv_hidden_size": 1536,
    "text_hidden_size": 7168,
    "vt_hidden_size": 1024,
    "vt_intermediate_size": 4096,
    "vt_num_attention_heads": 12,
    "vt_num_hidden_layers": 27,
}
TEXT = debug()
# K3's switches at odd sizes: attention wider than the tower (3 heads of 12), MLP 37, a 6 x 10 position table, 3 frames
SMALL_K3 = K3_VISION_CONFIG | {
    "vt_hidden_size": 22,
    "mm_hidden_size": 22,
    "qkv_hidden_size": 36,
    "vt_num_attention_heads": 3,
    "vt_intermediate_size": 37,
    "vt_num_hidden_layers": 2,
    "patch_size": 3,
    "init_pos_emb_height": 6,
    "init_pos_emb_width": 10,
    "init_pos_emb_time": 3,
    "text_hidden_size": TEXT.hidden_size,
}
# Kimi K2.5's tower: LayerNorm, biases everywhere, bicubic, the `patchmerger` projector with its pre-norm
SMALL_K25 = {k: v for k, v in SMALL_K3.items() if k not in ("qkv_hidden_size", "norm_type", "attn_bias", "linear_bias", "patch_embed_proj_bias")}
SMALL_K25 |= {"mm_projector_type": "patchmerger", "pos_emb_interpolation_mode": "bicubic", "vt_num_attention_heads": 2}
SMALL_K25 |= {"vt_hidden_size": 24, "mm_hidden_size": 24}
GRIDS = [(1, 6, 10), (1, 4, 8), (3, 2, 6), (1, 8, 14), (2, 4, 2)]  # at the table's size, smaller, a chunk, larger, two frames


def randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            is_norm_weight = "norm" in name and name.endswith("weight")
            p.copy_((1.0 if is_norm_weight else 0.0) + 0.3 * torch.randn(p.shape, generator=g))


def build_pair(vc: dict[str, Any], impl: str) -> tuple[Any, Any, K3ForCausalLM]:
    tower, projector = reference_from_vision_config(vc)
    randomise(tower, 1)
    randomise(projector, 2)
    model = K3ForCausalLM(TEXT, OpChoice(vision_attn=impl), vision_from_hf(vc, TEXT.hidden_size))
    model.vision_tower.load_state_dict(tower.state_dict(), strict=True)  # the same names and shapes, nothing left over
    model.mm_projector.load_state_dict(projector.state_dict(), strict=True)
    return tower, projector, model


def pixels(grids: list[tuple[int, int, int]], patch: int, seed: int = 3) -> torch.Tensor:
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, 3, patch, patch, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("impl", ["naive", "fast"])
@pytest.mark.parametrize("vc", [SMALL_K3, SMALL_K25], ids=["k3", "k2.5"])
def test_tower_and_projector_match_the_reference(vc: dict[str, Any], impl: str) -> None:
    tower, projector, model = build_pair(vc, impl)
    x = pixels(GRIDS, vc["patch_size"])
    with torch.no_grad():
        want_hidden, want_out = reference_forward(tower, projector, x, GRIDS)
        hidden = model.vision_tower(x, GRIDS)
        out = model.encode_images(x, GRIDS)
    torch.testing.assert_close(hidden, want_hidden, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out, want_out, atol=2e-5, rtol=1e-5)
    assert out.shape == (sum(merged_tokens(g, (2, 2)) for g in GRIDS), TEXT.hidden_size)


def test_images_do_not_see_each_other() -> None:
    _, _, model = build_pair(SMALL_K3, "naive")
    x = pixels(GRIDS[:2], SMALL_K3["patch_size"])
    first = GRIDS[0][0] * GRIDS[0][1] * GRIDS[0][2]
    with torch.no_grad():
        both = model.encode_images(x, GRIDS[:2])
        alone = model.encode_images(x[first:], GRIDS[1:2])
    torch.testing.assert_close(both[merged_tokens(GRIDS[0], (2, 2)) :], alone, atol=1e-5, rtol=1e-5)


def test_rotary_angles_turn_columns_then_rows() -> None:
    angles = rope_angles([Grid(2, 2, 3)], head_dim=8)  # f = (1, 10000^-0.5)
    assert angles.shape == (12, 4)
    torch.testing.assert_close(angles[5], torch.tensor([2.0, 1.0, 2.0 * 0.01, 1.0 * 0.01]))  # row 1, column 2
    torch.testing.assert_close(angles[6:], angles[:6])  # every frame at the same positions


def test_temporal_pooling_averages_frames_per_window() -> None:
    x = torch.arange(2 * 2 * 4, dtype=torch.float32)[:, None]  # t=2, h=2, w=4, D=1
    merged = tpool_merge(x, [(2, 2, 4)], (2, 2))
    assert merged.shape == (2, 4, 1)
    assert merged[:, :, 0].tolist() == [[4.0, 5.0, 8.0, 9.0], [6.0, 7.0, 10.0, 11.0]]


def test_the_release_vision_config() -> None:
    v = vision_from_hf(K3_VISION_CONFIG, 7168)
    assert (v.hidden_size, v.attn_width, v.head_dim, v.num_attention_heads, v.num_hidden_layers) == (1024, 1536, 128, 12, 27)
    assert (v.norm, v.projector, v.pos_emb_interpolation, v.merged_size) == (VisionNorm.RMSNORM, Projector.PATCHMERGER_V2, "bilinear", 4096)
    assert not (v.attn_bias or v.linear_bias or v.patch_embed_bias)
    assert vision_from_hf(vision_to_hf(v), 7168) == v
    model = K3ForCausalLM(TEXT, vision=vision_from_hf(SMALL_K3, TEXT.hidden_size))
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items() if n.startswith(("vision_tower.", "mm_projector."))}
    assert shapes == {
        "vision_tower.patch_embed.proj.weight": (22, 3, 3, 3),
        "vision_tower.patch_embed.pos_emb.weight": (6, 10, 22),
        **{f"vision_tower.encoder.blocks.{i}.{n}": s for i in range(2) for n, s in BLOCK_SHAPES.items()},
        "vision_tower.encoder.final_layernorm.weight": (22,),
        "mm_projector.proj.0.weight": (88, 88),
        "mm_projector.proj.2.weight": (TEXT.hidden_size, 88),
        "mm_projector.post_norm.weight": (TEXT.hidden_size,),
    }


BLOCK_SHAPES = {
    "norm0.weight": (22,),
    "norm1.weight": (22,),
    "wqkv.weight": (108, 22),
    "wo.weight": (22, 36),
    "mlp.fc0.weight": (37, 22),
    "mlp.fc1.weight": (22, 37),
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"frobnicate": 1}, "key 'frobnicate' not understood"),
        ({"merge_type": "sd2"}, "merge_type='sd2' is not supported"),
        ({"mm_projector_type": "identity"}, "mm_projector_type='identity' is not supported"),
        ({"projector_hidden_act": "relu"}, "projector_hidden_act='relu' is not supported"),
        ({"text_hidden_size": 7}, "text_hidden_size=7 differs"),
        ({"qkv_hidden_size": 30}, "head size \\(10\\) is a multiple of 4"),
    ],
)
def test_vision_config_refuses_what_it_does_not_implement(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        vision_from_hf(SMALL_K3 | change, TEXT.hidden_size)


def test_bad_inputs_are_named() -> None:
    _, _, model = build_pair(SMALL_K3, "naive")
    with pytest.raises(ValueError, match="multiples of the merge kernel"):
        model.vision_tower(pixels([(1, 3, 4)], 3), [(1, 3, 4)])
    with pytest.raises(ValueError, match="expected \\(8, 3, 3, 3\\)"):
        model.vision_tower(pixels([(1, 2, 2)], 3), [(1, 2, 4)])
    with pytest.raises(ValueError, match="4 frames exceeds the 3"):
        model.vision_tower(pixels([(4, 2, 2)], 3), [(4, 2, 2)])
    with pytest.raises(ValueError, match="no vision tower"):
        K3ForCausalLM(TEXT).encode_images(pixels([(1, 2, 2)], 3), [(1, 2, 2)])
    assert VisionConfig(8, 1, 1, 8, 8).pos_emb_interpolation == "bilinear"  # the K3 code's default when the key is absent

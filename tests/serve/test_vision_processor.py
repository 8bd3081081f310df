"""K3's image processor: media-token counts for several sizes and aspect ratios, worked out by hand from the published resize
rule (Kimi K2.5's `media_utils.navit_resize_image`, which Kimi K3's processor uses unchanged: vLLM's kimi_k25 processor
and vllm-ascend's kimi_k3 model transcribe it), for K3's `media_proc_cfg` (in_patch_limit 65536, 512 patches a side) and
Kimi K2.5's (in_patch_limit 16384). One figure is also published: 4000x3000 -> 143 x 108 = 15444 tokens under K3's
limits (the Lightseek multimodal token counter's K3 test). Then the pixels: normalisation, padding, patch order."""

from __future__ import annotations

import io

import pytest
import torch

from openk3.serve.vision_processor import LOW_DETAIL_PATCHES, ImageError, MediaConfig, process_image, resize_plan

PIL = pytest.importorskip("PIL.Image", reason="Pillow (the vision extra) decodes images")

K3 = MediaConfig()
K25 = MediaConfig(in_patch_limit=16384)


@pytest.mark.parametrize(
    ("cfg", "size", "tokens", "why"),
    [
        (K3, (640, 480), 414, "no resize; 640 -> 644 = 23 x 28, 480 -> 504 = 18 x 28"),
        (K3, (4000, 3000), 15444, "60990 patches fit 65536: padded to 4004 x 3024 = 143 x 108 (published)"),
        (K25, (4000, 3000), 4200, "scale sqrt(16384 / 60990) = 0.5183: 2073 x 1554 -> 75 x 56"),
        (K3, (21000, 100), 512, "one side capped at 512 patches: 7168 x 34 -> 256 x 2"),
        (K3, (100, 21000), 512, "the same, transposed"),
        (K3, (10, 10), 1, "smaller than a patch: padded to one 28 x 28 window"),
        (K3, (1, 1), 1, "one pixel"),
        (MediaConfig(fixed_output_tokens=64), (640, 480), 64, "fixed_output_tokens replaces the count"),
    ],
)
def test_media_token_counts(cfg: MediaConfig, size: tuple[int, int], tokens: int, why: str) -> None:
    plan = resize_plan(*size, cfg)
    assert plan.num_tokens == tokens, why
    w, h = plan.width + plan.pad_width, plan.height + plan.pad_height
    assert w % 28 == 0 and h % 28 == 0


def test_low_detail_caps_the_patches() -> None:
    plan = resize_plan(4000, 3000, K3, LOW_DETAIL_PATCHES)
    # scale sqrt(1024 / 60990) = 0.12957: 518 x 388 -> 532 x 392 = 19 x 14 windows
    assert (plan.width, plan.height, plan.num_tokens) == (518, 388, 266)


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_pixels_are_normalised_padded_and_cut_row_major() -> None:
    img = PIL.new("RGB", (50, 28), (255, 0, 0))
    img.paste((0, 0, 255), (28, 0, 50, 28))  # columns 28..49 blue
    out = process_image(png(img), K3)
    assert out.grid == (1, 2, 4) and out.num_tokens == 2 and (out.width, out.height) == (50, 28)
    assert out.pixels.shape == (8, 3, 14, 14)
    red, blue = torch.tensor([1.0, -1.0, -1.0]), torch.tensor([-1.0, -1.0, 1.0])
    first_row = out.pixels[:4, :, 0, 0]  # the top-left pixel of each patch of row 0
    assert torch.equal(first_row[0], red) and torch.equal(first_row[1], red) and torch.equal(first_row[2], blue)
    # columns 50..55 are padding: zero bytes, normalised to -1 in every channel
    assert torch.equal(out.pixels[3, :, 0, 13], torch.tensor([-1.0, -1.0, -1.0]))
    assert torch.equal(out.pixels[3, :, 0, 7], blue)  # column 49


def test_the_digest_follows_content_and_processing() -> None:
    a = png(PIL.new("RGB", (30, 30), (1, 2, 3)))
    b = png(PIL.new("RGB", (30, 30), (1, 2, 4)))
    assert process_image(a, K3).digest == process_image(a, K3).digest
    assert process_image(a, K3).digest != process_image(b, K3).digest
    assert process_image(a, K3).digest != process_image(a, K3, patch_limit=1).digest


def test_bad_images_are_named() -> None:
    with pytest.raises(ImageError, match="could not be decoded"):
        process_image(b"not an image", K3)
    with pytest.raises(ImageError, match="more than this server's limit of 100") as e:
        process_image(png(PIL.new("RGB", (20, 20))), K3, max_pixels=100)
    assert e.value.code == "image_too_large"


def test_preprocessor_config() -> None:
    k25 = {
        "media_proc_cfg": {
            "in_patch_limit": 16384,
            "patch_size": 14,
            "image_mean": [0.5, 0.5, 0.5],
            "image_std": [0.5, 0.5, 0.5],
            "merge_kernel_size": 2,
            "fixed_output_tokens": None,
            "patch_limit_on_one_side": 512,
            "in_patch_limit_each_frame": 4096,
            "in_patch_limit_video": None,
            "sample_fps": 2.0,
            "max_num_frames_each_video": None,
            "temporal_merge_kernel_size": 4,
            "timestamp_mode": "hh:mm:ss.fff",
        }
    }
    assert MediaConfig.from_json(k25) == K25
    assert MediaConfig.from_json({"media_proc_cfg": {"merge_kernel_size": [2, 2]}}) == K3
    with pytest.raises(ValueError, match="'in_token_limit' not understood"):
        MediaConfig.from_json({"media_proc_cfg": {"in_token_limit": 4096}})
    with pytest.raises(ValueError, match="key 'size' not understood"):
        MediaConfig.from_json({"size": 3})
    with pytest.raises(ValueError, match="image_std"):
        MediaConfig(image_std=(0.5, 0.0, 0.5))

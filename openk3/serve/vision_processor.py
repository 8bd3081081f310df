"""K3's image processor: bytes -> a decoded RGB image -> the release's NaViT resize and pad -> normalised patches, and how many
media tokens the image becomes in the prompt.

The rule is the release's (`kimi_k3_vision_processing.py` / Kimi K2.5's `media_utils.navit_resize_image`, as vLLM's
kimi_k25 / kimi_k3 processors transcribe it; written here from that description): with P the patch size, k the merge
kernel, `in_patch_limit` and `patch_limit_on_one_side` from `preprocessor_config.json`'s `media_proc_cfg`,
    scale = min(1, sqrt(in_patch_limit / (max(1, W // P) * max(1, H // P))), side * P / W, side * P / H)
    w, h = min(max(1, int(W * scale)), side * P), min(max(1, int(H * scale)), side * P)    (bicubic resize to w x h)
    then zero padding on the right and bottom up to multiples of k P; tokens = (h_pad / (k P)) * (w_pad / (k P))
(`fixed_output_tokens`, when set, replaces the count). Pixels are scaled to [0, 1] and normalised by `image_mean` /
`image_std`; patches are cut in row-major order, [L, 3, P, P], grid (1, h_pad / P, w_pad / P).
Pillow is the optional `vision` extra: it is imported where an image is decoded, and its absence is a clear error there.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from openk3.checks import check_int, fail

# media_proc_cfg keys the release ships for video input, which openk3 does not serve (an image part is one image)
VIDEO_KEYS = {
    "in_patch_limit_each_frame": "video input is not served (images only)",
    "in_patch_limit_video": "video input is not served (images only)",
    "max_num_frames_each_video": "video input is not served (images only)",
    "fixed_output_tokens_each_frame": "video input is not served (images only)",
    "sample_fps": "video input is not served (images only)",
    "temporal_merge_kernel_size": "video input is not served (images only); an image is one frame",
    "timestamp_mode": "video input is not served (images only)",
    "config_type": "a name",
}
TOP_LEVEL_IGNORED = {"auto_map": "openk3 runs no remote code", "processor_class": "a name", "image_processor_type": "a name"}
LOW_DETAIL_PATCHES = 1024  # `detail: low`: openk3's cap on patches before merging (256 tokens with a 2x2 kernel); not the release's


@dataclass(frozen=True)
class MediaConfig:
    """`preprocessor_config.json`'s `media_proc_cfg` (defaults: Kimi K3's release, in_patch_limit 65536, 512 patches a side)."""

    patch_size: int = 14
    merge_kernel_size: int = 2
    in_patch_limit: int = 65536
    patch_limit_on_one_side: int = 512
    fixed_output_tokens: int | None = None
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        for name in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side"):
            check_int("MediaConfig", name, getattr(self, name), low=1)
        check_int("MediaConfig", "fixed_output_tokens", self.fixed_output_tokens, low=1, optional=True)
        for name in ("image_mean", "image_std"):
            values = getattr(self, name)
            if len(values) != 3 or any(not isinstance(v, int | float) for v in values):
                fail("MediaConfig", name, values, "three numbers (R, G, B)")
        if any(v <= 0 for v in self.image_std):
            fail("MediaConfig", "image_std", self.image_std, "three positive numbers")

    @staticmethod
    def from_json(raw: dict[str, Any]) -> MediaConfig:
        """From the parsed preprocessor_config.json: its `media_proc_cfg`, every key read or named in VIDEO_KEYS; any other
        key (there or at the top level) is an error naming it."""
        unknown_top = sorted(set(raw) - {"media_proc_cfg"} - set(TOP_LEVEL_IGNORED))
        if unknown_top:
            raise ValueError(f"preprocessor_config.json key {unknown_top[0]!r} not understood (openk3 reads media_proc_cfg)")
        cfg = dict(raw.get("media_proc_cfg") or {})
        fields = set(MediaConfig.__dataclass_fields__)
        unknown = sorted(set(cfg) - fields - set(VIDEO_KEYS))
        if unknown:
            raise ValueError(f"preprocessor_config.json media_proc_cfg key {unknown[0]!r} not understood (known: {sorted(fields | set(VIDEO_KEYS))})")
        kwargs = {k: v for k, v in cfg.items() if k in fields}
        if isinstance(kwargs.get("merge_kernel_size"), list | tuple):
            kh, kw = kwargs["merge_kernel_size"]
            if kh != kw:
                raise ValueError(f"preprocessor_config.json media_proc_cfg merge_kernel_size={[kh, kw]}: the release's rule needs a square kernel")
            kwargs["merge_kernel_size"] = kh
        for name in ("image_mean", "image_std"):
            if name in kwargs:
                kwargs[name] = tuple(kwargs[name])
        return MediaConfig(**kwargs)


def read_media_config(folder: Path | None) -> MediaConfig | None:
    """The checkpoint folder's preprocessor_config.json, or None when there is none (image input then uses K3's values)."""
    file = None if folder is None else folder / "preprocessor_config.json"
    if file is None or not file.is_file():
        return None
    try:
        return MediaConfig.from_json(json.loads(file.read_text()))
    except ValueError as e:
        raise ValueError(f"{file}: {e}") from None


class ResizePlan(NamedTuple):
    width: int  # after the resize, before padding
    height: int
    pad_width: int
    pad_height: int
    num_tokens: int

    def grid(self, patch: int) -> tuple[int, int, int]:
        return (1, (self.height + self.pad_height) // patch, (self.width + self.pad_width) // patch)


def resize_plan(width: int, height: int, cfg: MediaConfig, patch_limit: int | None = None) -> ResizePlan:
    """The release's resize of a W x H image (module docstring); `patch_limit` lowers in_patch_limit (detail: low)."""
    p, side = cfg.patch_size, cfg.patch_limit_on_one_side
    limit = cfg.in_patch_limit if patch_limit is None else min(patch_limit, cfg.in_patch_limit)
    scale = min(1.0, math.sqrt(limit / (max(1.0, width // p) * max(1.0, height // p))), side * p / width, side * p / height)
    w, h = min(max(1, int(width * scale)), side * p), min(max(1, int(height * scale)), side * p)
    factor = cfg.merge_kernel_size * p
    pad_w, pad_h = (factor - w % factor) % factor, (factor - h % factor) % factor
    tokens = cfg.fixed_output_tokens or ((h + pad_h) // factor) * ((w + pad_w) // factor)
    return ResizePlan(w, h, pad_w, pad_h, tokens)


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One processed image: its patches, grid, media-token count, original size and content digest (the encoder cache's and
    the prefix cache's key: the bytes sent and the plan they were processed with)."""

    pixels: torch.Tensor = field(repr=False)  # [L, 3, P, P] float32
    grid: tuple[int, int, int]
    num_tokens: int
    width: int
    height: int
    digest: bytes


class ImageError(ValueError):
    """An image the processor cannot take; `code` is the OpenAI error code the API answers with."""

    def __init__(self, message: str, code: str = "invalid_image") -> None:
        super().__init__(message)
        self.code = code


def decode_image(data: bytes, max_pixels: int | None = None) -> Any:
    """The RGB PIL image of `data` (any format Pillow reads); ImageError when it is not an image or has more than
    `max_pixels` pixels (checked from the header, before the pixels are decoded)."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError as e:  # the optional `vision` extra
        raise ImageError("image input needs Pillow: pip install 'openk3[vision]'", code="unsupported") from e
    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError) as e:
        raise ImageError(f"the image data could not be decoded: {e}") from None
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise ImageError(f"the image is {width}x{height} = {width * height} pixels, more than this server's limit of {max_pixels}", code="image_too_large")
    try:
        return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"the image data could not be decoded: {e}") from None


def process_image(data: bytes, cfg: MediaConfig, patch_limit: int | None = None, max_pixels: int | None = None) -> ImageInput:
    """Decode, resize, pad, normalise and patchify one image (module docstring)."""
    from PIL import Image

    image = decode_image(data, max_pixels)
    plan = resize_plan(image.width, image.height, cfg, patch_limit)
    resized = image.resize((plan.width, plan.height), resample=Image.Resampling.BICUBIC)
    hwc = np.pad(np.asarray(resized, dtype=np.uint8), ((0, plan.pad_height), (0, plan.pad_width), (0, 0)))
    x = (hwc.astype(np.float32) / 255.0 - np.asarray(cfg.image_mean, np.float32)) / np.asarray(cfg.image_std, np.float32)
    p = cfg.patch_size
    grid = plan.grid(p)
    patches = x.reshape(grid[1], p, grid[2], p, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, p, p)
    digest = hashlib.blake2b(data + repr((plan, cfg)).encode(), digest_size=16).digest()
    return ImageInput(torch.from_numpy(np.ascontiguousarray(patches)), grid, plan.num_tokens, image.width, image.height, digest)

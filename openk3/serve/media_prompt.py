"""Images in a prompt: where each image's media tokens sit, the expansion of one `<|media_pad|>` per image to the image's
token count, and the ids the prefix cache keys a prompt with images by.

K3's prompt holds an image as `<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>` (W x H the size sent,
as the release's kimi_k3 processor writes it); the processor then repeats each `<|media_pad|>` as many times as the image
has tokens, images in prompt order (api/chat_k3.py renders the marker, `expand_media` repeats it). Prefix-cache keys: every
pad token of an image is keyed by the image's digest instead of the pad id, so two prompts that differ only in an image
share no cached prefix past it, and the same image hits (`cache_key_ids`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from openk3.serve.tokenizer import Tokenizer
from openk3.serve.vision_processor import ImageInput

MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD = "<|media_begin|>", "<|media_content|>", "<|media_end|>", "<|media_pad|>"
KEY_BASE = 1 << 62  # cache-key ids of image tokens lie above every vocabulary id (int64 keys, serve/cache/hashing.py)


class ImageSpan(NamedTuple):
    """An image's media tokens: prompt positions [start, start + image.num_tokens)."""

    start: int
    image: ImageInput

    @property
    def end(self) -> int:
        return self.start + self.image.num_tokens


def media_pad_id(tokenizer: Tokenizer) -> int | None:
    """The id of `<|media_pad|>` when the tokenizer has it (and the other media markers) as special tokens, else None."""
    names = tokenizer.special_token_strings
    if not {MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD} <= names:
        return None
    ids = tokenizer.encode(MEDIA_PAD)
    return ids[0] if len(ids) == 1 else None


def expand_media(ids: Sequence[int], pad_id: int, images: Sequence[ImageInput]) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """Each `pad_id` of `ids`, in order, repeated as many times as its image has tokens; the spans they take. ValueError
    when the prompt holds a different number of placeholders than images."""
    found = sum(1 for t in ids if t == pad_id)
    if found != len(images):
        raise ValueError(f"the prompt holds {found} media placeholders for {len(images)} images")
    out: list[int] = []
    spans: list[ImageSpan] = []
    for t in ids:
        if t == pad_id:
            image = images[len(spans)]
            spans.append(ImageSpan(len(out), image))
            out.extend([pad_id] * image.num_tokens)
        else:
            out.append(t)
    return out, tuple(spans)


def check_spans(spans: Sequence[ImageSpan], num_prompt_tokens: int) -> None:
    """Spans in prompt order, inside the prompt and apart; ValueError otherwise."""
    at = 0
    for i, s in enumerate(spans):
        if s.start < at or s.end > num_prompt_tokens or s.image.num_tokens < 1:
            raise ValueError(f"image {i}: tokens [{s.start}, {s.end}) overlap the previous image or leave the prompt of {num_prompt_tokens} tokens")
        at = s.end


def cache_key_ids(token_ids: list[int], spans: Sequence[ImageSpan], n: int | None = None) -> list[int]:
    """The first `n` (default all) token ids with each image's tokens replaced by one id of its digest (module docstring);
    without images the ids themselves."""
    ids = token_ids if n is None else token_ids[:n]
    if not spans:
        return ids
    ids = list(ids)
    for s in spans:
        if s.start >= len(ids):
            break
        key = KEY_BASE + int.from_bytes(s.image.digest[:7], "little")
        ids[s.start : min(s.end, len(ids))] = [key] * (min(s.end, len(ids)) - s.start)
    return ids


def image_token_count(spans: Sequence[ImageSpan]) -> int:
    return sum(s.image.num_tokens for s in spans)

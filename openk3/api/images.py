"""Image parts of a request: OpenAI's chat `image_url` parts and the Responses API's `input_image` items -> processed images
(serve/vision_processor.py) placed in the prompt's token ids (serve/media_prompt.py).

`data:` URLs with base64 data are read in place; an http(s) URL is fetched only from hosts the operator allows
(`--allowed-media-domains`, api/media_fetch.py), else it is a 400 naming the field. `detail`
is `auto` / `high` (the release's limits) or `low` (at most vision_processor.LOW_DETAIL_PATCHES patches). The server's
limits -- images per request, bytes per image (decoded), pixels per image (from the header, before decoding) -- are
RequestLimits settings, each a 400 naming the part and the flag. A model without a vision tower, or served without K3's
encoding and a tokenizer that has the media tokens, answers any image part with a 400 naming it.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from openk3.api.chat_k3 import K3Template
from openk3.api.chat_loading import ChatRenderer
from openk3.api.errors import APIError
from openk3.api.limits import RequestLimits
from openk3.api.media_fetch import MediaFetchConfig
from openk3.api.protocol import ChatMessage
from openk3.config.vision import VisionConfig
from openk3.serve.media_prompt import ImageSpan, expand_media, media_pad_id
from openk3.serve.tokenizer import Tokenizer
from openk3.serve.vision_processor import LOW_DETAIL_PATCHES, ImageError, ImageInput, MediaConfig, process_image

DETAILS = ("auto", "low", "high")
NO_FETCH = "only data: URLs (base64 images in the request) are accepted: this server fetches no URLs (openk3 serve --allowed-media-domains)"
_DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*),(?P<data>.*)", re.S)


@dataclass(frozen=True)
class ImageRef:
    """One image part as sent: where it is (`param`, for errors), its URL and its detail."""

    param: str
    url: str
    detail: str = "auto"


@dataclass(frozen=True)
class MediaSupport:
    """What a server that takes images needs: the processor's settings, the `<|media_pad|>` id, and which hosts image URLs
    may be fetched from."""

    config: MediaConfig
    pad_id: int
    fetch: MediaFetchConfig = MediaFetchConfig()


def refuse(ref: ImageRef, message: str, code: str = "invalid_value", param_suffix: str = "") -> APIError:
    return APIError(400, f"{ref.param}{param_suffix}: {message}", param=ref.param + param_suffix, code=code)


def is_remote(ref: ImageRef) -> bool:
    return re.match(r"https?://", ref.url.strip(), re.I) is not None


def remote_refs(refs: Sequence[ImageRef], fetch: MediaFetchConfig) -> dict[int, ImageRef]:
    """The parts whose image is at an http(s) URL, by position; a 400 for the first one when this server fetches nothing."""
    remote = {i: ref for i, ref in enumerate(refs) if is_remote(ref)}
    if remote and not fetch.enabled:
        raise refuse(next(iter(remote.values())), NO_FETCH, "unsupported", ".url")
    return remote


def image_bytes(ref: ImageRef, max_bytes: int) -> bytes:
    """The bytes of a base64 `data:` URL, within `max_bytes` (checked on the encoded length first: no decoding of a body
    that cannot fit)."""
    url = ref.url.strip()
    if is_remote(ref):
        raise refuse(ref, NO_FETCH, "unsupported", ".url")  # an http(s) part without a fetched body
    match = _DATA_URL.fullmatch(url)
    if match is None or "base64" not in [p.strip().lower() for p in match["params"].split(";")]:
        raise refuse(ref, "expected a data URL of a base64 image (data:image/png;base64,...)", param_suffix=".url")
    if match["mime"] and not match["mime"].lower().startswith("image/"):
        raise refuse(ref, f"the data URL's type {match['mime']!r} is not an image type", param_suffix=".url")
    data = match["data"]
    limit = f"more than this server's limit of {max_bytes} (openk3 serve --max-image-mb)"
    if len(data) * 3 // 4 > max_bytes + 3:
        raise refuse(ref, f"the image is about {len(data) * 3 // 4} bytes, {limit}", "image_too_large")
    try:
        raw = base64.b64decode(re.sub(r"\s", "", data), validate=True)
    except (binascii.Error, ValueError):
        raise refuse(ref, "the data URL's base64 data is malformed", param_suffix=".url") from None
    if len(raw) > max_bytes:
        raise refuse(ref, f"the image is {len(raw)} bytes, {limit}", "image_too_large")
    return raw


def check_count(refs: Sequence[ImageRef], limits: RequestLimits) -> None:
    if len(refs) > limits.max_images_per_request:
        first = refs[limits.max_images_per_request]
        message = (
            f"the request has {len(refs)} images, more than this server's limit of {limits.max_images_per_request} (openk3 serve --max-images-per-request)"
        )
        raise refuse(first, message, "limit_exceeded")
    for ref in refs:
        if ref.detail not in DETAILS:
            raise refuse(ref, f"detail {ref.detail!r} is not one of {list(DETAILS)}", param_suffix=".detail")


def load_images(refs: Sequence[ImageRef], media: MediaSupport, limits: RequestLimits, fetched: Mapping[int, bytes] | None = None) -> list[ImageInput]:
    """Each image decoded and processed, in order; a 400 naming the first part that is refused (module docstring).
    `fetched`: the bodies of the http(s) parts, by position, already fetched (api/media_fetch.py)."""
    check_count(refs, limits)
    out = []
    for i, ref in enumerate(refs):
        data = fetched[i] if fetched is not None and i in fetched else image_bytes(ref, limits.max_image_bytes)
        cap = LOW_DETAIL_PATCHES if ref.detail == "low" else None
        try:
            out.append(process_image(data, media.config, cap, limits.max_image_pixels))
        except ImageError as e:
            hint = " (openk3 serve --max-image-pixels)" if e.code == "image_too_large" else ""
            raise refuse(ref, f"{e}{hint}", e.code) from None
    return out


def no_images(messages: Sequence[ChatMessage]) -> None:
    """The 400 of a server that takes no images, naming the first image part of the messages (if any)."""
    for i, m in enumerate(messages):
        for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
            if part.type == "image_url":
                param = f"messages[{i}].content[{j}].image_url"
                why = "this model does not take images (it has no vision tower, or is not served with K3's encoding and media tokens)"
                raise APIError(400, f"{param}: {why}", param=param, code="unsupported")


def place(ids: list[int], images: Sequence[ImageInput], media: MediaSupport) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """The prompt ids with each image's one placeholder repeated to its token count, and the images' spans."""
    try:
        return expand_media(ids, media.pad_id, images)
    except ValueError as e:  # request text that spells the placeholder is text (api/user_text.py): this means a broken render
        raise APIError(400, str(e), param="messages", code="invalid_value") from None


def media_support(
    vision: VisionConfig | None, tokenizer: Tokenizer, renderer: ChatRenderer, config: MediaConfig | None, fetch: MediaFetchConfig | None = None
) -> MediaSupport | None:
    """What the server needs to take images, or None when it cannot: the engine's model has no vision tower, the prompt is
    not K3's encoding (the one format here that places images), or the tokenizer lacks the media tokens. Without a
    preprocessor_config.json the processor takes K3's limits and the tower's patch size and kernel; a file whose patches or
    merge kernel differ from the tower's is a ValueError at start-up."""
    pad_id = media_pad_id(tokenizer)
    if vision is None or not isinstance(renderer, K3Template) or pad_id is None:
        return None
    kh, kw = vision.merge_kernel_size
    if config is None and kh != kw:
        raise ValueError(f"the vision tower's merge kernel {[kh, kw]} is not square: the release's processor needs a preprocessor_config.json for it")
    media = config or MediaConfig(patch_size=vision.patch_size, merge_kernel_size=kh)  # no file: K3's limits, the tower's patches
    k = media.merge_kernel_size
    if media.patch_size != vision.patch_size or (k, k) != tuple(vision.merge_kernel_size):
        got = f"patch_size={media.patch_size}, merge_kernel_size={k}"
        raise ValueError(f"preprocessor_config.json {got} differs from the vision tower's {vision.patch_size} and {list(vision.merge_kernel_size)}")
    return MediaSupport(media, pad_id, fetch or MediaFetchConfig())


def chat_image_refs(messages: Sequence[ChatMessage]) -> list[ImageRef]:
    """The `image_url` parts of chat messages, in prompt order; a malformed part, or one outside a user message, is a 400."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.content, list):
            continue
        for j, part in enumerate(m.content):
            if part.type != "image_url":
                continue
            param = f"messages[{i}].content[{j}].image_url"
            extra = dict(part.model_extra or {})
            body = extra.pop("image_url", None)
            if extra or part.text is not None:
                bad = sorted(extra)[0] if extra else "text"
                raise APIError(
                    400, f"messages[{i}].content[{j}].{bad} is not supported: an image part has type and image_url", param=param, code="invalid_value"
                )
            if isinstance(body, str):
                body = {"url": body}
            if not isinstance(body, dict) or not isinstance(body.get("url"), str) or set(body) - {"url", "detail"}:
                raise APIError(400, f"{param}: expected an object with a url (and optionally detail)", param=param, code="invalid_value")
            if m.role != "user":
                raise APIError(400, f"{param}: images are accepted in user messages only", param=param, code="invalid_value")
            out.append(ImageRef(param, body["url"], body.get("detail") or "auto"))
    return out

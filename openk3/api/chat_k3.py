"""Kimi K3's encoding (api/k3_encoding.py) as a chat renderer: the same face as api/chat.py's ChatTemplate, fed the same
checked messages (chat.message_dicts), so the server, /tokenize and the demo model go through one code path."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from openk3.api.chat import ChatOptions, PromptRenderer, message_dicts
from openk3.api.chat_format import ChatFormat
from openk3.api.k3_encoding import END_OF_MSG, MediaPart, k3_options, k3_segments
from openk3.api.protocol import ChatMessage
from openk3.api.user_text import PromptText


def _without_images(m: ChatMessage) -> ChatMessage:
    if not isinstance(m.content, list):
        return m
    return m.model_copy(update={"content": [p for p in m.content if p.type != "image_url"]})


def _image(sizes: Iterator[tuple[int, int]]) -> MediaPart:
    size = next(sizes, None)
    if size is None:
        raise ValueError("an image part has no processed image (ChatOptions.image_sizes names one per image part)")
    return MediaPart(*size)


class K3Template(PromptRenderer):
    """Kimi K3's encoding (api/k3_encoding.py) behind the same face as a ChatTemplate: it renders tools, writes the K3
    format, ends a turn with `<|end_of_msg|>` and reads the chat_template_kwargs k3_encoding.KWARGS names."""

    format = ChatFormat.KIMI_K3
    uses_tools = True
    end_of_turn_markers = (END_OF_MSG,)
    end_of_turn = END_OF_MSG

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def check_kwargs(self, kwargs: dict[str, Any] | None) -> None:
        k3_options(dict(kwargs or {}), None, None, None)

    def check_effort(self, effort: str, kwargs: dict[str, Any] | None) -> None:
        k3_options(dict(kwargs or {}), effort, None, None)

    def render_prompt(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        special_tokens: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        markers: Iterable[str] = (),
        options: ChatOptions | None = None,
    ) -> PromptText:
        """The prompt; every text segment is a plain span (the release's tokenizer never reads special tokens in them), so
        `special_tokens` and `markers` are not needed: only the encoding's own control segments become special tokens."""
        o = options or ChatOptions()
        k3 = k3_options(dict(extra or {}), o.reasoning_effort, o.tool_choice, o.response_format)
        dicts = message_dicts([_without_images(m) for m in messages])
        sizes = iter(o.image_sizes)
        for d, m in zip(dicts, messages, strict=True):
            if isinstance(m.content, list):  # each text part is its own segment, as the release encodes them; an image its marker
                d["content"] = [_image(sizes) if part.type == "image_url" else part.text or "" for part in m.content]
            if d["role"] == "developer":  # K3 has no developer role (the published encoding drops it): it is the system's
                d["role"] = "system"
        text, plain, cuts, size = [], [], [], 0
        for segment in k3_segments(dicts, tools, k3, add_generation_prompt):
            if not segment.control:
                plain.append((size, size + len(segment.text)))
            text.append(segment.text)
            size += len(segment.text)
            cuts.append(size)
        return PromptText("".join(text), tuple(plain), tuple(cuts))

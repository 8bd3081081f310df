"""Request text inside a rendered chat prompt stays text: a marker a user, a tool result or a tool description writes
(`<|im_end|>`, `<|tool_calls_section_begin|>`) must not become the control token the template's own marker is.

The chat template is rendered with every request string's special-token strings hidden: each occurrence is swapped for one
code point of Unicode's plane 16 (private use, which no template or tokenizer gives a meaning), indexed into a table, so the
template sees ordinary text it cannot mistake for a marker and string tests such as `'</think>' in content` are not fooled.
So is any part of a string that could join with the text beside it into a marker (a string ending in `<|im_`, or starting
with `end|>`). After rendering the code points are put back and their places returned as plain spans: the tokenizer then
reads special tokens only outside them (`Tokenizer.encode_with_plain`). Plane-16 characters a request sends are hidden the
same way, so they come back unchanged and never stand for a table entry.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, NamedTuple

from openk3.serve.tokenizer import Tokenizer

_BASE = 0x100000
_LIMIT = 0xFFFE  # plane 16 has 65534 usable code points: a render may hide that many strings
_PLANE16 = "[\U00100000-\U0010ffff]"
_WORD = re.compile(r"\w+")


class PromptText(NamedTuple):
    text: str
    plain: tuple[tuple[int, int], ...]  # character ranges of `text` that are request text holding a special-token string
    # positions where `text` is cut into separately encoded pieces: K3's encoding has its tokenizer encode every segment as
    # its own BPE run (api/chat_k3.py); a Jinja template's prompt is encoded whole, as Hugging Face does (no cuts)
    cuts: tuple[int, ...] = ()


def encode_prompt_text(tokenizer: Tokenizer, prompt: PromptText) -> list[int]:
    """The ids of a rendered prompt: special tokens read only outside its plain spans, each piece between cuts apart."""
    if not prompt.cuts:
        return tokenizer.encode_with_plain(prompt.text, prompt.plain)
    ids: list[int] = []
    bounds = [0, *(c for c in prompt.cuts if 0 < c < len(prompt.text)), len(prompt.text)]
    for a, b in zip(bounds, bounds[1:], strict=False):
        if a < b:
            spans = [(max(s, a) - a, min(e, b) - a) for s, e in prompt.plain if s < b and a < e]
            ids += tokenizer.encode_with_plain(prompt.text[a:b], spans) if spans else tokenizer.encode(prompt.text[a:b])
    return ids


class UserText:
    """One render's table of hidden strings: `hide` the request's values, render, `reveal` the template's output."""

    def __init__(self, markers: Iterable[str]) -> None:
        self._markers = sorted({m for m in markers if m}, key=len, reverse=True)
        alternatives = [re.escape(m) for m in self._markers] + [_PLANE16]
        self._pattern = re.compile("|".join(alternatives))
        self._hidden: list[str] = []

    def hide(self, value: Any) -> Any:
        """`value` (strings, and lists and dicts of them, keys included) with its marker text hidden."""
        if isinstance(value, str):
            return self._hide_str(value)
        if isinstance(value, list):
            return [self.hide(v) for v in value]
        if isinstance(value, dict):
            return {self.hide(k): self.hide(v) for k, v in value.items()}
        return value

    def _hide_str(self, s: str) -> str:
        if not self._markers and not any(ord(c) >= _BASE for c in s):
            return s
        head, tail = self._edge(s, start=True), self._edge(s, start=False)
        if head + tail > len(s):
            tail = len(s) - head
        middle = self._pattern.sub(lambda m: self._slot(m.group()), s[head : len(s) - tail])
        return (self._slot(s[:head]) if head else "") + middle + (self._slot(s[len(s) - tail :]) if tail else "")

    def _edge(self, s: str, start: bool) -> int:
        """The longest start of `s` that ends a marker (or end of `s` that begins one): it could join the text before
        (after) it into a marker. Word characters alone are left as they are: values the template compares (`assistant`,
        `function`) and dict keys it looks up must stay themselves, and markers are told apart by their punctuation."""
        best = 0
        for m in self._markers:
            for n in range(min(len(m) - 1, len(s)), best, -1):
                piece = m[-n:] if start else m[:n]
                if (s.startswith(piece) if start else s.endswith(piece)) and not _WORD.fullmatch(piece):
                    best = n
                    break
        return best

    def _slot(self, original: str) -> str:
        if len(self._hidden) >= _LIMIT:
            raise ValueError(f"the request holds more than {_LIMIT} special-token strings")
        self._hidden.append(original)
        return chr(_BASE + len(self._hidden) - 1)

    def reveal(self, rendered: str) -> PromptText:
        """The rendered prompt with the hidden strings back, and where they are."""
        if not self._hidden:
            return PromptText(rendered, ())
        parts: list[str] = []
        plain: list[tuple[int, int]] = []
        pos = size = 0
        for m in re.finditer(_PLANE16, rendered):
            k = ord(m.group()) - _BASE
            if k >= len(self._hidden):
                continue  # the template's own character (none of ours)
            parts.append(rendered[pos : m.start()])
            size += m.start() - pos
            plain.append((size, size + len(self._hidden[k])))
            parts.append(self._hidden[k])
            size += len(self._hidden[k])
            pos = m.end()
        parts.append(rendered[pos:])
        return PromptText("".join(parts), tuple(plain))

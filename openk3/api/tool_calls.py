"""Tool calls out of a reply's answer text, incrementally, for the two Kimi formats (api/chat_format.py).

Fed the answer text piece by piece, a parser returns the content settled so far and the call events settled so far: a
`CallOpened` when a call's header is complete and names an offered tool, then `ArgumentsText` fragments of that call's
arguments (a JSON object, as text) as the model writes them. So a stream sends a call's arguments token by token, as OpenAI
does, and the fragments of one call always concatenate to the arguments a whole (non-streamed) reply returns: both run the
same parser, and every decision is taken per character, never per piece.

What is checked before anything of a call is sent: its header (K2 `functions.NAME:IDX`, then the arguments' first `{`; K3
`<|open|>call tool="NAME" ...<|sep|>`), and that NAME is offered. A header that is malformed, names another tool, or is cut
off makes the rest of the text content, markers and all. After that the arguments are sent while they can still be valid:
K2's JSON is checked character by character (api/json_prefix.py), K3's typed argument blocks are converted as they come (a
string argument streams as JSON string text; another type is sent whole at its block's close, once its literal checks). At
the first text that cannot continue the call (a JSON error, a marker out of place, a bad argument block) the call ends with
the arguments sent so far and the rest of the reply is content; a reply that ends inside a call (max_tokens) keeps the
arguments it wrote. In both cases the arguments are then not a whole JSON object -- a stream cannot take back what it sent,
so neither does the whole reply; a grammar-enforced call (api/tool_choice.py) cannot end so. Only a held-back marker prefix
waits; there is no size limit on a call (vLLM once had an 8 KB one, #37184) and no regex that can run across two calls
(#24478): calls are cut at their own markers. The two formats' parsers: api/tool_calls_k2.py, api/tool_calls_k3.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from openk3.api.reasoning import find_marker, held_back

MAX_HEADER = 512  # characters of a call header before its end: a longer one is not a header, and is not held back longer


@dataclass(frozen=True)
class CallOpened:
    name: str
    index: str  # the model's own index (K2: part of the id)


@dataclass(frozen=True)
class ArgumentsText:
    text: str  # the next fragment of the last opened call's arguments


CallEvent = CallOpened | ArgumentsText


class CallParser:
    """The shared loop: `_step` consumes from the front of the unparsed text and says whether to go on."""

    def __init__(self, tool_names: frozenset[str] | None, state: str) -> None:
        self.tool_names = tool_names  # None: calls are not parsed (tool_choice "none"): the text is content
        self._state = state
        self._buf = ""
        self._content: list[str] = []
        self._events: list[CallEvent] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[CallEvent]]:
        self._buf += text
        while self._buf and self._step(final):
            pass
        content, events = "".join(self._content), self._events
        self._content, self._events = [], []
        return content, events

    def _step(self, final: bool) -> bool:
        raise NotImplementedError

    def _raw(self, rest: str) -> bool:
        """Everything from here on is content."""
        self._state, self._buf = "raw", rest
        return True

    def _emit(self, text: str) -> None:
        if text:
            self._events.append(ArgumentsText(text))

    def _text_until(self, markers: tuple[str, ...], final: bool) -> tuple[int, str] | None:
        """Emit content up to the first marker (returned) or, with none, up to a possible marker prefix."""
        found = find_marker(self._buf, markers, final)
        if found is not None:
            self._content.append(self._buf[: found[0]])
            return found
        cut = len(self._buf) if final else len(self._buf) - held_back(self._buf, markers)
        self._content.append(self._buf[:cut])
        self._buf = self._buf[cut:]
        return None

    def _until(self, markers: tuple[str, ...], final: bool) -> tuple[int, tuple[int, str] | None]:
        """How much of the buffer is settled text before the first marker (or a possible marker prefix), and the marker."""
        found = find_marker(self._buf, markers, final)
        if found is not None:
            return found[0], found
        return (len(self._buf) if final else len(self._buf) - held_back(self._buf, markers)), None

    def _header(self, opener: str, others: tuple[str, ...], end: str, final: bool) -> int | None:
        """Where the header that starts the buffer (with `opener`) ends (the index of `end`), once it is whole; None while
        it may still come. A header holding another marker, too long, or cut off by the end of the reply is content."""
        p = self._buf.find(end, len(opener))
        body = self._buf[len(opener) : p if p >= 0 else len(self._buf)]
        if any(m in body for m in others) or len(body) > MAX_HEADER or (p < 0 and final):
            self._raw(self._buf)
            return None
        return p if p >= 0 else None

"""Kimi K3's tool calls, parsed incrementally (api/tool_calls.py says what is sent when): after the reasoning, the response
block's text is content, and the tools block holds `<|open|>call tool="NAME" index="N"<|sep|>` blocks of typed arguments
`<|open|>argument key="K" type="T"<|sep|>value<|close|>argument<|sep|>`, converted to one JSON object as they come.
Where SGLang's K3 detector tests say otherwise than api/tool_calls.py's shared rules, this parser follows them: a value not of
its type is kept as a string; markup the end of the reply cuts is dropped, never content; a tools block nobody offered is
dropped (docs/serving.md, Agent API)."""

from __future__ import annotations

import html
import json
import logging
import re

from openk3.api import chat_format as f
from openk3.api.reasoning import find_marker, held_back, starts_with_marker_prefix
from openk3.api.tool_calls import CallOpened, CallParser

_ATTRS = re.compile(r'\s+([A-Za-z_]+)="([^"]*)"')
log = logging.getLogger("openk3.api")
_K3_TYPES = {"number": (int, float), "boolean": (bool,), "null": (type(None),), "object": (dict,), "array": (list,)}


def _open_tag(text: str, tag: str) -> tuple[dict[str, str], str] | None:
    """`<|open|>TAG a="x"...<|sep|>` at the start of `text`: (attributes, the text after it)."""
    head = f.OPEN + tag
    sep = text.find(f.SEP)
    if not text.startswith(head) or sep < 0:
        return None
    attrs, pos, inner = {}, 0, text[len(head) : sep]
    for m in _ATTRS.finditer(inner):
        if m.start() != pos:
            return None
        attrs[m.group(1)] = html.unescape(m.group(2))
        pos = m.end()
    return (attrs, text[sep + len(f.SEP) :]) if inner[pos:].strip() == "" else None


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def _k3_literal(kind: str, text: str) -> str | None:
    """A non-string argument's value as its JSON literal, kept exactly as written (`1e2` stays `1e2`), if it has the type."""
    literal = text.strip()
    try:
        value = json.loads(literal, parse_constant=_no_constant)
    except ValueError:
        return None
    types = _K3_TYPES.get(kind)
    ok = types is not None and isinstance(value, types) and not (kind == "number" and isinstance(value, bool))
    return literal if ok else None


def _cut_marker(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` are a marker the end of the reply cut, once it holds a whole control token
    (`<|close|>argu`); a bare `<` or `<|clo` stays text, as SGLang's K3 detector keeps it."""
    n = held_back(text, markers)
    return n if any(t in text[len(text) - n :] for t in (f.OPEN, f.CLOSE, f.SEP)) else 0


def _json_string_text(text: str) -> str:
    """`text` as it appears inside a JSON string; escaping pieces one by one gives the escape of the whole."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


class KimiK3ToolParser(CallParser):
    """The K3 reply after its reasoning: the response block's text is content, the tools block's calls are calls."""

    def __init__(self, tool_names: frozenset[str] | None, in_response: bool) -> None:
        super().__init__(tool_names, "response" if in_response else "top")
        self._keys: set[str] = set()
        self._kind = "string"  # the type of the argument being read
        self._arg_head = ""  # the raw block head of a non-string argument: content if its value turns out bad
        self._head_json = ""  # ... and its JSON key, sent with the value once the value checks

    _TOP = (f.K3_RESPONSE_OPEN, f.K3_TOOLS_OPEN, f.K3_MESSAGE_CLOSE, f.K3_RESPONSE_CLOSE, f.K3_THINK_CLOSE)
    _OUT_OF_PLACE = (f.K3_CALL_CLOSE, f.K3_TOOLS_CLOSE, f.K3_MESSAGE_CLOSE, f.K3_CALL_OPEN)  # inside an argument value

    def _step(self, final: bool) -> bool:
        if self._state == "raw":
            self._content.append(self._buf)
            self._buf = ""
            return False
        if self._state == "response":
            markers = (f.K3_RESPONSE_CLOSE, f.K3_TOOLS_OPEN, f.K3_MESSAGE_CLOSE)
            if final and find_marker(self._buf, markers, True) is None and (n := _cut_marker(self._buf, markers)):
                self._buf = self._buf[:-n]  # the end of the reply cut a block marker: it is not the answer's text
            found = self._text_until(markers, final)
            if found is None:
                return False
            p, marker = found  # a tools block or the message's end closes the response as well
            self._buf = self._buf[p + len(marker) :] if marker == f.K3_RESPONSE_CLOSE else self._buf[p:]
            self._state = "top"
            return True
        step = {
            "call": self._call_step,
            "arguments": self._arguments_step,
            "string": self._string_step,
            "literal": self._literal_step,
            "unoffered": self._unoffered_step,
        }
        if self._state in step:
            return step[self._state](final)
        s = self._buf.lstrip()
        if not s:
            return False
        if self._state == "tools":
            return self._tools_step(s, final)
        for marker in self._TOP:  # between blocks: whitespace, block markers; a stray close is dropped
            if s.startswith(marker):
                self._buf = s[len(marker) :]
                if marker == f.K3_TOOLS_OPEN:
                    self._state = "tools" if self.tool_names is not None else "unoffered"
                self._state = {f.K3_RESPONSE_OPEN: "response", f.K3_MESSAGE_CLOSE: "raw"}.get(marker, self._state)
                return True
        if not final and starts_with_marker_prefix(s, self._TOP):
            return False
        self._buf, self._state = s, "response"  # text outside any block: the model's answer all the same
        return True

    def _cut(self, what: str) -> bool:
        """The reply ended inside tool markup (max_tokens): the markup is dropped, never content; a call opened before
        keeps the arguments it sent (the reply's finish_reason is `length`)."""
        log.info("a K3 reply ended inside %s: the unfinished markup (%d characters) is dropped", what, len(self._buf))
        self._state, self._buf = "raw", ""
        return False

    def _unoffered_step(self, final: bool) -> bool:
        """A tools block although no tools are parsed (none offered, or tool_choice none): dropped up to its close."""
        found = find_marker(self._buf, (f.K3_TOOLS_CLOSE, f.K3_MESSAGE_CLOSE), final)
        if found is None:
            self._buf = self._buf[len(self._buf) - held_back(self._buf, (f.K3_TOOLS_CLOSE, f.K3_MESSAGE_CLOSE)) :] if not final else ""
            return False
        end = found[0] + (len(f.K3_TOOLS_CLOSE) if found[1] == f.K3_TOOLS_CLOSE else 0)
        self._buf, self._state = self._buf[end:], "top"
        return True

    def _tools_step(self, s: str, final: bool) -> bool:
        if s.startswith(f.K3_TOOLS_CLOSE):
            self._buf, self._state = s[len(f.K3_TOOLS_CLOSE) :], "top"
            return True
        if s.startswith(f.K3_CALL_OPEN):
            self._buf, self._state = s, "call"
            return True
        if starts_with_marker_prefix(s, (f.K3_TOOLS_CLOSE, f.K3_CALL_OPEN)):
            return self._cut("the tools block") if final else False
        return self._raw(s)

    def _call_step(self, final: bool) -> bool:
        if final and f.SEP not in self._buf and not any(m in self._buf[len(f.K3_CALL_OPEN) :] for m in (f.OPEN, f.CLOSE)):
            return self._cut("a call header")
        p = self._header(f.K3_CALL_OPEN, (f.OPEN, f.CLOSE, f.K3_MESSAGE_CLOSE), f.SEP, final)
        if p is None:
            return self._state == "raw"
        opened = _open_tag(self._buf, "call")
        if opened is None or self.tool_names is None or opened[0].get("tool") not in self.tool_names:
            return self._raw(self._buf)
        attrs, rest = opened
        self._events.append(CallOpened(attrs["tool"], attrs.get("index", "")))
        self._buf, self._state, self._keys = rest, "arguments", set()
        return True

    def _arguments_step(self, final: bool) -> bool:
        """Between a call's argument blocks: the next block's head, or the call's close."""
        s = self._buf.lstrip()
        if not s:
            self._buf = ""
            return False
        self._buf = s
        if s.startswith(f.K3_CALL_CLOSE):
            self._emit("}" if self._keys else "{}")
            self._buf, self._state = s[len(f.K3_CALL_CLOSE) :], "tools"
            return True
        if not s.startswith(f.K3_ARG_OPEN):
            if starts_with_marker_prefix(s, (f.K3_CALL_CLOSE, f.K3_ARG_OPEN)):
                return self._cut("a call's close") if final else False
            return self._raw(s)
        if final and f.SEP not in s:
            return self._cut("an argument header")
        p = self._header(f.K3_ARG_OPEN, (f.OPEN, f.CLOSE), f.SEP, final)
        if p is None:
            return self._state == "raw"
        arg = _open_tag(s, "argument")
        kind = "string" if arg is None else arg[0].get("type", "string")
        if arg is None or "key" not in arg[0] or arg[0]["key"] in self._keys or (kind != "string" and kind not in _K3_TYPES):
            return self._raw(s)
        key = json.dumps(arg[0]["key"], ensure_ascii=False)
        head = ("{" if not self._keys else ", ") + key + ": "
        self._keys.add(arg[0]["key"])
        self._kind, self._buf = kind, arg[1]
        if kind == "string":
            self._emit(head + '"')
            self._state = "string"
        else:
            self._arg_head, self._head_json, self._state = s[: p + len(f.SEP)], head, "literal"
        return True

    def _string_step(self, final: bool) -> bool:
        markers = (f.K3_ARG_CLOSE, *self._OUT_OF_PLACE)
        settled, found = self._until(markers, final)
        if final and found is None:
            settled -= _cut_marker(self._buf, markers)  # the end of the reply cut a marker: not argument text
        self._emit(_json_string_text(self._buf[:settled]))
        self._buf = self._buf[settled:]
        if found is None:
            return self._cut("a string argument") if final and self._buf else False
        if found[1] != f.K3_ARG_CLOSE:
            return self._raw(self._buf)
        self._emit('"')
        self._buf, self._state = self._buf[len(f.K3_ARG_CLOSE) :], "arguments"
        return True

    def _literal_step(self, final: bool) -> bool:
        found = find_marker(self._buf, (f.K3_ARG_CLOSE, *self._OUT_OF_PLACE), final)
        if found is None:
            return self._cut(f"a {self._kind} argument") if final else False
        if found[1] != f.K3_ARG_CLOSE:
            return self._raw(self._arg_head + self._buf)  # the block, head and all, is where the call went wrong
        literal = _k3_literal(self._kind, self._buf[: found[0]])
        if literal is None:  # not a literal of its type: the value as written, as a string (SGLang's rule)
            literal = json.dumps(self._buf[: found[0]], ensure_ascii=False)
        self._emit(self._head_json + literal)
        self._buf, self._state = self._buf[found[0] + len(f.K3_ARG_CLOSE) :], "arguments"
        return True

"""Kimi K3's tool calls, parsed incrementally (api/tool_calls.py says what is sent when): after the reasoning, the response
block's text is content, and the tools block holds `<|open|>call tool="NAME" index="N"<|sep|>` blocks of typed arguments
`<|open|>argument key="K" type="T"<|sep|>value<|close|>argument<|sep|>`, converted to one JSON object as they come."""

from __future__ import annotations

import html
import json
import re

from openk3.api import chat_format as f
from openk3.api.reasoning import find_marker, starts_with_marker_prefix
from openk3.api.tool_calls import CallOpened, CallParser

_ATTRS = re.compile(r'\s+([A-Za-z_]+)="([^"]*)"')
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
            found = self._text_until((f.K3_RESPONSE_CLOSE, f.K3_TOOLS_OPEN, f.K3_MESSAGE_CLOSE), final)
            if found is None:
                return False
            p, marker = found  # a tools block or the message's end closes the response as well
            self._buf = self._buf[p + len(marker) :] if marker == f.K3_RESPONSE_CLOSE else self._buf[p:]
            self._state = "top"
            return True
        step = {"call": self._call_step, "arguments": self._arguments_step, "string": self._string_step, "literal": self._literal_step}
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
                    if self.tool_names is None:
                        return self._raw(s)
                    self._state = "tools"
                self._state = {f.K3_RESPONSE_OPEN: "response", f.K3_MESSAGE_CLOSE: "raw"}.get(marker, self._state)
                return True
        if not final and starts_with_marker_prefix(s, self._TOP):
            return False
        self._buf, self._state = s, "response"  # text outside any block: the model's answer all the same
        return True

    def _tools_step(self, s: str, final: bool) -> bool:
        if s.startswith(f.K3_TOOLS_CLOSE):
            self._buf, self._state = s[len(f.K3_TOOLS_CLOSE) :], "top"
            return True
        if s.startswith(f.K3_CALL_OPEN):
            self._buf, self._state = s, "call"
            return True
        if not final and starts_with_marker_prefix(s, (f.K3_TOOLS_CLOSE, f.K3_CALL_OPEN)):
            return False
        return self._raw(s)

    def _call_step(self, final: bool) -> bool:
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
            if not final and starts_with_marker_prefix(s, (f.K3_CALL_CLOSE, f.K3_ARG_OPEN)):
                return False
            return self._raw(s)
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
        settled, found = self._until((f.K3_ARG_CLOSE, *self._OUT_OF_PLACE), final)
        self._emit(_json_string_text(self._buf[:settled]))
        self._buf = self._buf[settled:]
        if found is None:
            return self._raw(self._buf) if final and self._buf else False
        if found[1] != f.K3_ARG_CLOSE:
            return self._raw(self._buf)
        self._emit('"')
        self._buf, self._state = self._buf[len(f.K3_ARG_CLOSE) :], "arguments"
        return True

    def _literal_step(self, final: bool) -> bool:
        found = find_marker(self._buf, (f.K3_ARG_CLOSE, *self._OUT_OF_PLACE), final)
        if found is None:
            return self._raw(self._arg_head + self._buf) if final else False
        literal = _k3_literal(self._kind, self._buf[: found[0]]) if found[1] == f.K3_ARG_CLOSE else None
        if literal is None:
            return self._raw(self._arg_head + self._buf)  # the block, head and all, is where the call went wrong
        self._emit(self._head_json + literal)
        self._buf, self._state = self._buf[found[0] + len(f.K3_ARG_CLOSE) :], "arguments"
        return True

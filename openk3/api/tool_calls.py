"""Tool calls out of a reply's answer text, incrementally, for the two Kimi formats (api/chat_format.py).

Fed the answer text piece by piece, a parser returns the content settled so far and the calls completed so far. A call is
returned only once it is complete and valid -- its end marker seen, a name among the offered tools, arguments that are a
JSON object (K2) or typed arguments that convert to one (K3) -- so a stream never announces a call that later turns out
cut off or malformed, and the streamed calls always equal the non-streamed ones. From the first call that is malformed, or
still open when the reply ends (max_tokens), the rest of the text is content, markers and all: the client sees what the
model wrote. Only a held-back marker prefix and the call being written wait; there is no size limit on a call (vLLM once
had an 8 KB one, #37184) and no regex that can run across two calls (#24478): calls are cut at their own end markers.
"""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass

from openk3.api import chat_format as f
from openk3.api.chat_format import ChatFormat
from openk3.api.reasoning import find_marker, held_back, starts_with_marker_prefix


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as text
    index: str  # the model's own index (K2: part of the id)


class _Parser:
    """The shared loop: `_step` consumes from the front of the unparsed text and says whether to go on."""

    def __init__(self, tool_names: frozenset[str] | None, state: str) -> None:
        self.tool_names = tool_names  # None: calls are not parsed (tool_choice "none"): the text is content
        self._state = state
        self._buf = ""
        self._content: list[str] = []
        self._calls: list[ParsedCall] = []

    def feed(self, text: str, final: bool) -> tuple[str, list[ParsedCall]]:
        self._buf += text
        while self._buf and self._step(final):
            pass
        content, calls = "".join(self._content), self._calls
        self._content, self._calls = [], []
        return content, calls

    def _step(self, final: bool) -> bool:
        raise NotImplementedError

    def _raw(self, rest: str) -> bool:
        """Everything from here on is content."""
        self._state, self._buf = "raw", rest
        return True

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


_K2_HEADER = re.compile(r"(?:functions\.)?([A-Za-z0-9_.\-]+):(\d+)")


class KimiK2ToolParser(_Parser):
    def __init__(self, tool_names: frozenset[str] | None) -> None:
        super().__init__(tool_names, "content" if tool_names is not None else "raw")

    def _step(self, final: bool) -> bool:
        if self._state == "raw":
            self._content.append(self._buf)
            self._buf = ""
            return False
        if self._state == "content":
            found = self._text_until((f.SECTION_BEGIN, f.CALL_BEGIN), final)
            if found is None:
                return False
            p, marker = found  # a bare <|tool_call_begin|> (no section) is taken as one
            self._buf = self._buf[p + len(marker) :] if marker == f.SECTION_BEGIN else self._buf[p:]
            self._state = "section"
            return True
        s = self._buf.lstrip()
        if not s:
            return False
        if s.startswith(f.SECTION_END):
            self._buf, self._state = s[len(f.SECTION_END) :], "content"
            return True
        if s.startswith(f.CALL_BEGIN):
            end = s.find(f.CALL_END)
            body = s[len(f.CALL_BEGIN) : end if end >= 0 else len(s)]
            if any(m in body for m in (f.CALL_BEGIN, f.SECTION_BEGIN, f.SECTION_END)):
                return self._raw(s)  # another call or the section's end before this call ended
            if end < 0:
                return self._raw(s) if final else False
            call = self._call(body)
            if call is None:
                return self._raw(s)
            self._calls.append(call)
            self._buf = s[end + len(f.CALL_END) :]
            return True
        if not final and starts_with_marker_prefix(s, (f.SECTION_END, f.CALL_BEGIN)):
            return False
        return self._raw(s)

    def _call(self, body: str) -> ParsedCall | None:
        header, sep, arguments = body.partition(f.ARGS_BEGIN)
        match = _K2_HEADER.fullmatch(header.strip())
        if not sep or match is None or self.tool_names is None or match.group(1) not in self.tool_names:
            return None
        arguments = arguments.strip()
        try:
            value = json.loads(arguments, parse_constant=_no_constant)
        except ValueError:
            return None
        return ParsedCall(match.group(1), arguments, match.group(2)) if isinstance(value, dict) else None


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


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


def _k3_value(kind: str, text: str) -> str | None:
    """An argument's value as a JSON literal: strings as written, other types as their own JSON text (kept exactly)."""
    if kind == "string":
        return json.dumps(text, ensure_ascii=False)
    literal = text.strip()
    try:
        value = json.loads(literal, parse_constant=_no_constant)
    except ValueError:
        return None
    types = _K3_TYPES.get(kind)
    ok = types is not None and isinstance(value, types) and not (kind == "number" and isinstance(value, bool))
    return literal if ok else None


class KimiK3ToolParser(_Parser):
    """The K3 reply after its reasoning: the response block's text is content, the tools block's calls are calls."""

    def __init__(self, tool_names: frozenset[str] | None, in_response: bool) -> None:
        super().__init__(tool_names, "response" if in_response else "top")

    _TOP = (f.K3_RESPONSE_OPEN, f.K3_TOOLS_OPEN, f.K3_MESSAGE_CLOSE, f.K3_RESPONSE_CLOSE, f.K3_THINK_CLOSE)

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
            end = s.find(f.K3_CALL_CLOSE)
            body = s[: end if end >= 0 else len(s)]
            if any(m in body for m in (f.K3_TOOLS_CLOSE, f.K3_MESSAGE_CLOSE)) or body.count(f.K3_CALL_OPEN) > 1:
                return self._raw(s)
            if end < 0:
                return self._raw(s) if final else False
            call = self._call(body)
            if call is None:
                return self._raw(s)
            self._calls.append(call)
            self._buf = s[end + len(f.K3_CALL_CLOSE) :]
            return True
        if not final and starts_with_marker_prefix(s, (f.K3_TOOLS_CLOSE, f.K3_CALL_OPEN)):
            return False
        return self._raw(s)

    def _call(self, body: str) -> ParsedCall | None:
        opened = _open_tag(body, "call")
        if opened is None or self.tool_names is None or opened[0].get("tool") not in self.tool_names:
            return None
        attrs, rest = opened
        fields: dict[str, str] = {}
        while rest.strip():
            arg = _open_tag(rest.lstrip(), "argument")
            if arg is None or "key" not in arg[0] or arg[0]["key"] in fields:
                return None
            value, sep, rest = arg[1].partition(f.K3_ARG_CLOSE)
            literal = _k3_value(arg[0].get("type", "string"), value) if sep else None
            if literal is None:
                return None
            fields[arg[0]["key"]] = literal
        arguments = "{" + ", ".join(f"{json.dumps(k, ensure_ascii=False)}: {v}" for k, v in fields.items()) + "}"
        return ParsedCall(attrs["tool"], arguments, attrs.get("index", ""))


def tool_parser(fmt: ChatFormat, tool_names: frozenset[str] | None, in_response: bool) -> _Parser:
    if fmt is ChatFormat.KIMI_K3:
        return KimiK3ToolParser(tool_names, in_response)
    return KimiK2ToolParser(tool_names)

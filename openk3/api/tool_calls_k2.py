"""Kimi K2's tool-call sections, parsed incrementally (api/tool_calls.py says what is sent when): `<|tool_calls_section_begin|>`,
per call `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>`, then
`<|tool_calls_section_end|>`; a bare call without its section is taken as one."""

from __future__ import annotations

import re

from openk3.api import chat_format as f
from openk3.api.json_prefix import JsonObjectPrefix
from openk3.api.reasoning import starts_with_marker_prefix
from openk3.api.tool_calls import CallOpened, CallParser

_K2_HEADER = re.compile(r"(?:functions\.)?([A-Za-z0-9_.\-]+):(\d+)")
_K2_MARKERS = (f.SECTION_BEGIN, f.SECTION_END, f.CALL_BEGIN, f.ARGS_BEGIN, f.CALL_END)


class KimiK2ToolParser(CallParser):
    def __init__(self, tool_names: frozenset[str] | None) -> None:
        super().__init__(tool_names, "content" if tool_names is not None else "raw")
        self._json = JsonObjectPrefix()

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
        if self._state == "header":
            return self._header_step(final)
        if self._state == "arguments":
            return self._arguments_step(final)
        s = self._buf.lstrip()
        if not s:
            return False
        if s.startswith(f.SECTION_END):
            self._buf, self._state = s[len(f.SECTION_END) :], "content"
            return True
        if s.startswith(f.CALL_BEGIN):
            self._buf, self._state = s, "header"
            return True
        if not final and starts_with_marker_prefix(s, (f.SECTION_END, f.CALL_BEGIN)):
            return False
        return self._raw(s)

    def _header_step(self, final: bool) -> bool:
        others = tuple(m for m in _K2_MARKERS if m != f.ARGS_BEGIN)
        p = self._header(f.CALL_BEGIN, others, f.ARGS_BEGIN, final)
        if p is None:
            return self._state == "raw"
        match = _K2_HEADER.fullmatch(self._buf[len(f.CALL_BEGIN) : p].strip())
        if match is None or self.tool_names is None or match.group(1) not in self.tool_names:
            return self._raw(self._buf)
        rest = self._buf[p + len(f.ARGS_BEGIN) :].lstrip()
        if not rest:
            return self._raw(self._buf) if final else False
        if rest[0] != "{":  # arguments that are not an object: the call is never announced
            return self._raw(self._buf)
        self._events.append(CallOpened(match.group(1), match.group(2)))
        self._buf, self._state, self._json = rest, "arguments", JsonObjectPrefix()
        return True

    def _arguments_step(self, final: bool) -> bool:
        settled, found = self._until(_K2_MARKERS, final)
        accepted, part = self._json.feed(self._buf[:settled])
        self._emit(self._buf[:part])
        self._buf = self._buf[accepted:]  # whitespace after the object is read but is not part of the arguments
        if accepted < settled:
            return self._raw(self._buf)  # a character that no JSON object can continue with
        if found is None:
            return self._raw(self._buf) if final and self._buf else False
        if found[1] == f.CALL_END and self._json.done:
            self._buf, self._state = self._buf[len(f.CALL_END) :], "section"
            return True
        return self._raw(self._buf)  # another marker, or the call's end before its arguments are whole

"""Whether a text, read one character at a time, is still the start of a JSON object, and where the object ends.

A streamed K2 tool call sends its arguments as the model writes them (api/tool_calls.py); this is what decides, character
by character, that they still can become a JSON object, so the parser can stop at the first character that cannot be one
(the rest of the reply is then content) instead of sending text that no JSON parser would take. It checks exactly what
`json.loads` checks (strings without raw control characters, valid escapes, numbers in JSON's grammar, true/false/null), so a
text it reads to completion is one `json.loads` accepts; `NaN` and `Infinity` are not JSON and are refused here too.
"""

from __future__ import annotations

import re
from enum import Enum

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NUMBER_PREFIX = re.compile(r"-|-?(?:0|[1-9]\d*)(?:\.\d*)?(?:[eE][+-]?\d*)?")
_WHITESPACE = " \t\n\r"
_ESCAPES = '"\\/bfnrt'
_HEX = "0123456789abcdefABCDEF"
_LITERALS = {"t": "true", "f": "false", "n": "null"}


class _At(Enum):
    START = "start"  # before the object's `{`
    VALUE = "value"
    FIRST_ITEM = "first_item"  # after `[`: a value or `]`
    FIRST_KEY = "first_key"  # after `{`: a key or `}`
    KEY = "key"  # after `,` in an object
    COLON = "colon"
    AFTER = "after"  # after a value: `,` or the container's close
    STRING = "string"
    ESCAPE = "escape"
    HEX = "hex"
    NUMBER = "number"
    LITERAL = "literal"
    DONE = "done"


class JsonObjectPrefix:
    def __init__(self) -> None:
        self._at = _At.START
        self._stack: list[str] = []  # "{" or "["
        self._key = False  # the string being read is an object key
        self._word = ""  # the number or literal being read; for a literal, the word it must become
        self._read = ""
        self._hex = 0

    @property
    def done(self) -> bool:
        """The object is complete (only whitespace may follow)."""
        return self._at is _At.DONE

    def feed(self, text: str) -> tuple[int, int]:
        """Reads `text` up to its first character that cannot continue the object: (characters accepted, characters of
        them that belong to the object -- whitespace after its closing `}` is accepted but is not part of it)."""
        part = 0
        for i, ch in enumerate(text):
            was_done = self.done
            if not self._accept(ch):
                return i, part
            if not was_done:
                part = i + 1
        return len(text), part

    def _accept(self, ch: str) -> bool:
        at = self._at
        if at is _At.STRING:
            if ch == '"':
                self._at = _At.COLON if self._key else _At.AFTER
            elif ch == "\\":
                self._at = _At.ESCAPE
            elif ord(ch) < 0x20:
                return False
            return True
        if at is _At.ESCAPE:
            if ch not in _ESCAPES + "u":
                return False
            self._at, self._hex = (_At.HEX, 4) if ch == "u" else (_At.STRING, 0)
            return True
        if at is _At.HEX:
            if ch not in _HEX:
                return False
            self._hex -= 1
            if self._hex == 0:
                self._at = _At.STRING
            return True
        if at is _At.NUMBER:
            if _NUMBER_PREFIX.fullmatch(self._word + ch):
                self._word += ch
                return True
            if not _NUMBER.fullmatch(self._word):
                return False
            self._at = _At.AFTER
            return self._accept(ch)
        if at is _At.LITERAL:
            if self._word[len(self._read)] != ch:
                return False
            self._read += ch
            if self._read == self._word:
                self._at = _At.AFTER
            return True
        if ch in _WHITESPACE:
            return True
        if at is _At.START:
            return self._open(ch) if ch == "{" else False
        if at is _At.DONE:
            return False
        if at in (_At.FIRST_KEY, _At.KEY):
            if ch == "}" and at is _At.FIRST_KEY:
                return self._close(ch)
            if ch != '"':
                return False
            self._at, self._key = _At.STRING, True
            return True
        if at is _At.COLON:
            if ch != ":":
                return False
            self._at = _At.VALUE
            return True
        if at is _At.AFTER:
            top = self._stack[-1]
            if ch == ",":
                self._at = _At.KEY if top == "{" else _At.VALUE
                return True
            return self._close(ch) if ch == ("}" if top == "{" else "]") else False
        if at is _At.FIRST_ITEM and ch == "]":
            return self._close(ch)
        return self._value(ch)

    def _value(self, ch: str) -> bool:
        if ch in "{[":
            return self._open(ch)
        if ch == '"':
            self._at, self._key = _At.STRING, False
        elif ch == "-" or ch.isdigit() and ch.isascii():
            self._at, self._word = _At.NUMBER, ch
        elif ch in _LITERALS:
            self._at, self._word, self._read = _At.LITERAL, _LITERALS[ch], ch
        else:
            return False
        return True

    def _open(self, ch: str) -> bool:
        self._stack.append(ch)
        self._at = _At.FIRST_KEY if ch == "{" else _At.FIRST_ITEM
        return True

    def _close(self, ch: str) -> bool:
        self._stack.pop()
        self._at = _At.AFTER if self._stack else _At.DONE
        return True

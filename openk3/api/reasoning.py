"""Reasoning apart from the answer, incrementally: the model's text in, (reasoning, answer) pieces out.

Fed the decoded text of one sample piece by piece (each step's new text), it returns what is settled: a marker that may be
cut across two steps (`</th` + `ink>`) is held back until it is whole or cannot be one, so the concatenated pieces always
equal the split of the whole text (`final=True` flushes). The reply is reasoning from its start when the generation
prompt opened the reasoning block (K2-Thinking's `<think>`, K3's `<|open|>think<|sep|>`); in the K2 format the model may
also open it itself with `<think>`. Reasoning ends at its close marker (dropped) or, as vLLM learned the hard way, at the
first marker that can only come after it (kept, for the tool-call parser): K2 models sometimes go straight from reasoning to
`<|tool_calls_section_begin|>`, and K3 sometimes omits `<|close|>think<|sep|>` or its `<|sep|>` (vLLM #53246, SGLang #32567).
Reasoning that never ends (a reply cut by max_tokens) is all reasoning, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

from openk3.api import chat_format as f
from openk3.api.chat_format import ChatFormat

_CLOSES = {
    ChatFormat.KIMI_K2: (f.THINK_CLOSE,),
    ChatFormat.KIMI_K3: (f.K3_THINK_CLOSE, f.K3_THINK_CLOSE_ELIDED),
}
_IMPLICIT_ENDS = {
    ChatFormat.KIMI_K2: (f.SECTION_BEGIN, f.CALL_BEGIN),
    ChatFormat.KIMI_K3: (f.K3_RESPONSE_OPEN, f.K3_RESPONSE_CLOSE, f.K3_TOOLS_OPEN, f.K3_MESSAGE_CLOSE),
}


def find_marker(text: str, markers: Sequence[str], final: bool) -> tuple[int, str] | None:
    """The earliest marker in `text` (the longest where two start at the same place), or None. Not final, a match that a
    longer marker could still extend (`<|close|>think` before its `<|sep|>`) is not decided yet: None."""
    best: tuple[int, str] | None = None
    for m in markers:
        p = text.find(m)
        if p >= 0 and (best is None or p < best[0] or (p == best[0] and len(m) > len(best[1]))):
            best = p, m
    if best is not None and not final:
        rest = text[best[0] :]
        if any(len(m) > len(rest) and m.startswith(rest) for m in markers):
            return None
    return best


def held_back(text: str, markers: Sequence[str]) -> int:
    """How many characters at the end of `text` could be the start of a marker (so must wait for the next piece)."""
    for n in range(min(len(text), max(map(len, markers)) - 1), 0, -1):
        tail = text[-n:]
        if any(m.startswith(tail) for m in markers):
            return n
    return 0


def starts_with_marker_prefix(text: str, markers: Sequence[str]) -> bool:
    """Whether `text` is the start of one of `markers` (it may still become it)."""
    return any(m.startswith(text) for m in markers)


class ReasoningSplitter:
    def __init__(self, fmt: ChatFormat, in_reasoning: bool) -> None:
        self.fmt = fmt
        self._closes = _CLOSES[fmt]
        self._ends = self._closes + _IMPLICIT_ENDS[fmt]
        # K2: a reply not started inside reasoning may still open it with <think> (held until it is clear)
        self._state = "reasoning" if in_reasoning else ("maybe" if fmt is ChatFormat.KIMI_K2 else "answer")
        self._buf = ""
        self.saw_reasoning = in_reasoning

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, answer) settled by this piece."""
        self._buf += text
        reasoning, answer = [], []
        if self._state == "maybe":
            head = self._buf.lstrip()
            if head.startswith(f.THINK_OPEN):
                self._buf, self._state, self.saw_reasoning = head[len(f.THINK_OPEN) :], "reasoning", True
            elif final or not starts_with_marker_prefix(head, (f.THINK_OPEN,)):
                self._state = "answer"
        if self._state == "reasoning":
            found = find_marker(self._buf, self._ends, final)
            if found is not None:
                p, marker = found
                reasoning.append(self._buf[:p])
                self._buf = self._buf[p + len(marker) :] if marker in self._closes else self._buf[p:]
                self._state = "answer"
            elif final:
                reasoning.append(self._buf)
                self._buf = ""
            else:
                keep = held_back(self._buf, self._ends)
                cut = len(self._buf) - keep
                reasoning.append(self._buf[:cut])
                self._buf = self._buf[cut:]
        if self._state == "answer":
            answer.append(self._buf)
            self._buf = ""
        return "".join(reasoning), "".join(answer)

"""One chat choice's text as the agent API returns it: reasoning, content and tool calls, streamed or whole.

A `ChoiceParser` is fed the sample's decoded text (each step's new text, or the whole text once) and returns what is
settled: reasoning first (api/reasoning.py), then the answer split into content and tool-call pieces (api/tool_calls.py),
as OpenAI streams them: a call's first piece carries its `index` (0, 1, ... within the reply), `id`, `type` and name with
arguments "", each later piece the same `index` and the next fragment of its arguments. A whole response is the same
pieces put together (`assemble`). The text written into the prompt to force a call (api/tool_choice.py) is parsed first, as
the start of the reply, and shows up nowhere. Streams and whole responses run the same parser, so a stream's pieces always
add up to the whole response.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from openk3.api.chat_format import ChatFormat, PromptEnd, call_id
from openk3.api.protocol import FunctionCall, ToolCall
from openk3.api.reasoning import ReasoningSplitter, held_back
from openk3.api.responses import DeltaFunctionCall, DeltaToolCall
from openk3.api.tool_calls import CallOpened, CallParser
from openk3.api.tool_calls_k2 import KimiK2ToolParser
from openk3.api.tool_calls_k3 import KimiK3ToolParser
from openk3.api.tool_choice import ToolPlan


@dataclass
class Piece:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)  # a call's opening piece, then its argument fragments

    def calls(self) -> list[ToolCall]:
        return assemble(self.tool_calls)


class HiddenTokens:
    """Drops the text of special tokens that are not the format's markers (`<|reserved_token_N|>`, `[UNK]`, ...): the reply
    is decoded with special tokens kept so that the parsers see the markers, and the others must never reach a client as
    text. A possible start of one at the end of a piece waits for the next."""

    def __init__(self, hidden: frozenset[str]) -> None:
        self._hidden = tuple(sorted(hidden, key=len, reverse=True))
        self._pattern = re.compile("|".join(map(re.escape, self._hidden))) if hidden else None
        self._tail = ""

    def feed(self, text: str, final: bool) -> str:
        if self._pattern is None:
            return text
        text = self._pattern.sub("", self._tail + text)
        keep = 0 if final else held_back(text, self._hidden)
        self._tail = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]


class ChoiceParser:
    def __init__(self, plan: ToolPlan, end: PromptEnd, forced_prefix: str = "", hidden: frozenset[str] = frozenset()) -> None:
        """`hidden`: the special-token strings to drop from the reply (HiddenTokens)."""
        assert plan.fmt is not None, "nothing to parse without a chat format"
        self.plan = plan
        self._hidden = HiddenTokens(hidden)
        self._fmt = plan.fmt
        self._reasoning = ReasoningSplitter(plan.fmt, end.in_reasoning)
        self._tools = tool_parser(plan.fmt, plan.tool_names, end.in_response)
        self._ids: set[str] = set()
        self._text_tail = ""  # the last characters fed, to see whether the stop string is already there
        self.num_calls = 0
        self.has_reasoning = False
        self._opened_by_prompt: list[DeltaToolCall] = []
        # a forced K3 call is opened by the prompt itself: its opening piece goes out with the reply's first piece
        self._opened_by_prompt = self.feed(forced_prefix).tool_calls if forced_prefix else []

    def feed(self, text: str, final: bool = False, stop_reason: int | str | None = None) -> Piece:
        stop = self.plan.call_stop()
        if final and stop is not None and stop_reason == stop and not (self._text_tail + text).endswith(stop):
            text += stop  # the reply was stopped at the end of its first call (parallel_tool_calls false): close it
        self._text_tail = (self._text_tail + text)[-32:]
        reasoning, answer = self._reasoning.feed(self._hidden.feed(text, final), final)
        content, events = self._tools.feed(answer, final)
        self.has_reasoning = self.has_reasoning or self._reasoning.saw_reasoning
        out = Piece(reasoning, content, self._opened_by_prompt)
        self._opened_by_prompt = []
        for event in events:
            if isinstance(event, CallOpened):
                cid = self._unique(call_id(self._fmt, event.name, event.index))
                opened = DeltaFunctionCall(name=event.name, arguments="")
                out.tool_calls.append(DeltaToolCall(index=self.num_calls, id=cid, type="function", function=opened))
                self.num_calls += 1
                continue
            last = out.tool_calls[-1] if out.tool_calls else None
            if last is not None and last.id is None:  # this step's fragments of one call go out as one piece
                last.function.arguments = (last.function.arguments or "") + event.text
            else:
                out.tool_calls.append(DeltaToolCall(index=self.num_calls - 1, function=DeltaFunctionCall(arguments=event.text)))
        return out

    def _unique(self, base: str) -> str:
        """Ids must tell the calls of one reply apart even when a weak model repeats an index."""
        cid, k = base, 1
        while cid in self._ids:
            k += 1
            cid = f"{base}-{k}"
        self._ids.add(cid)
        return cid

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the reply ended by itself after calling tools; "length" stays "length"."""
        return "tool_calls" if engine_reason == "stop" and self.num_calls else engine_reason


def assemble(pieces: list[DeltaToolCall]) -> list[ToolCall]:
    """Whole calls out of their stream pieces (what a client does with a stream)."""
    calls: dict[int, ToolCall] = {}
    for p in pieces:
        if p.id is not None:
            calls[p.index] = ToolCall(id=p.id, function=FunctionCall(name=p.function.name or "", arguments=""))
        calls[p.index].function.arguments += p.function.arguments or ""
    return list(calls.values())


def tool_parser(fmt: ChatFormat, tool_names: frozenset[str] | None, in_response: bool) -> CallParser:
    if fmt is ChatFormat.KIMI_K3:
        return KimiK3ToolParser(tool_names, in_response)
    return KimiK2ToolParser(tool_names)

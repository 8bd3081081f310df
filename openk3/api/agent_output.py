"""One chat choice's text as the agent API returns it: reasoning, content and tool calls, streamed or whole.

A `ChoiceParser` is fed the sample's decoded text (each step's new text, or the whole text once) and returns what is
settled: reasoning first (api/reasoning.py), then the answer split into content and complete calls (api/tool_calls.py). The
text written into the prompt to force a call (api/tool_choice.py) is parsed first, as the start of the reply, and shows up
nowhere. Streams and whole responses run the same parser, so a stream's pieces always add up to the whole response.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from openk3.api.chat_format import PromptEnd, call_id
from openk3.api.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from openk3.api.reasoning import ReasoningSplitter
from openk3.api.tool_calls import tool_parser
from openk3.api.tool_choice import ToolPlan


@dataclass
class Piece:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ChoiceParser:
    def __init__(self, plan: ToolPlan, end: PromptEnd, forced_prefix: str = "") -> None:
        assert plan.fmt is not None, "nothing to parse without a chat format"
        self.plan = plan
        self._fmt = plan.fmt
        self._reasoning = ReasoningSplitter(plan.fmt, end.in_reasoning)
        self._tools = tool_parser(plan.fmt, plan.tool_names, end.in_response)
        self._ids: set[str] = set()
        self._text_tail = ""  # the last characters fed, to see whether the stop string is already there
        self.num_calls = 0
        self.has_reasoning = False
        if forced_prefix:
            self.feed(forced_prefix)

    def feed(self, text: str, final: bool = False, stop_reason: int | str | None = None) -> Piece:
        stop = self.plan.call_stop()
        if final and stop is not None and stop_reason == stop and not (self._text_tail + text).endswith(stop):
            text += stop  # the reply was stopped at the end of its first call (parallel_tool_calls false): close it
        self._text_tail = (self._text_tail + text)[-32:]
        reasoning, answer = self._reasoning.feed(text, final)
        content, calls = self._tools.feed(answer, final)
        self.has_reasoning = self.has_reasoning or self._reasoning.saw_reasoning
        out = Piece(reasoning, content)
        for c in calls:  # with parallel_tool_calls false generation stops after the first, so there is at most one
            out.calls.append(ToolCall(id=self._unique(call_id(self._fmt, c.name, c.index)), function=FunctionCall(name=c.name, arguments=c.arguments)))
            self.num_calls += 1
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


def call_deltas(calls: list[ToolCall], first_index: int) -> list[list[DeltaToolCall]]:
    """The stream pieces of complete calls, as OpenAI streams them: per call one piece with its id, type and name (and
    empty arguments), then one with its arguments."""
    out = []
    for i, c in enumerate(calls, start=first_index):
        out.append([DeltaToolCall(index=i, id=c.id, type="function", function=DeltaFunctionCall(name=c.function.name, arguments=""))])
        out.append([DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=c.function.arguments))])
    return out

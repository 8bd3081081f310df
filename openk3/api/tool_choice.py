"""What a chat request asks of tools, checked against what the server can honour: `tools`, `tool_choice`,
`parallel_tool_calls`, and the chat format that decides how calls are written (api/chat_format.py).

- "none": the tools are not shown to the template (so the model is not invited to call them) and nothing is parsed as a
  call: any section the model still writes is plain content.
- "auto" (the default with tools): the template gets the tools; complete, valid calls are parsed out of the reply.
- named (`{"type": "function", "function": {"name": N}}`), and "required" with exactly one tool (the same thing): enforced
  by writing the start of the call into the prompt (the open blocks closed, the tool section opened, the call header up to
  its arguments: `chat_format.forced_call_prefix`), so the reply is the arguments of a call of N. The arguments are the
  model's own, not checked against the schema -- OpenAI's non-strict function calling; `strict: true` is refused.
- "required" with several tools: refused (400) -- choosing among names is a constraint on the tokens themselves, which
  needs the grammar engine (structured output, issue 19 item 5).
- `parallel_tool_calls: false`: enforced by stopping at the end of the first call.

`ToolPlan` is the seam for that grammar: it names the chat format, the tools the reply may call and the one it must call;
a structured-output backend can turn it into a structural tag (section begin, one of the names, the schema's arguments)
and then lift the two refusals above, without touching the parsers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from openk3.api import chat_format as f
from openk3.api.chat_format import ChatFormat
from openk3.api.errors import APIError
from openk3.api.protocol import ChatCompletionRequest, NamedToolChoice, Tool

STRUCTURED = "needs structured-output support (constrained decoding, not in this server yet)"


@dataclass(frozen=True)
class ToolPlan:
    fmt: ChatFormat | None  # None: the template writes no format the server parses (no reasoning or tool parsing)
    tools: tuple[Tool, ...] = ()  # shown to the template
    tool_names: frozenset[str] | None = None  # the names a parsed call may have; None: nothing is parsed as a call
    forced: str | None = None  # the function the reply must call
    parallel: bool = True

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def call_stop(self) -> str | None:
        """The stop string that ends the reply after its first call (parallel_tool_calls false)."""
        if self.parallel or self.fmt is None or self.tool_names is None:
            return None
        return f.CALL_END if self.fmt is ChatFormat.KIMI_K2 else f.K3_CALL_CLOSE


def plan_tools(req: ChatCompletionRequest, fmt: ChatFormat | None, template_uses_tools: bool) -> ToolPlan:
    tools = tuple(req.tools or ())
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"tools names {dup!r} twice: tool names must be unique", param="tools", code="invalid_value")
    strict = next((t.function.name for t in tools if t.function.strict), None)
    if strict is not None:
        raise APIError(400, f"tools[{names.index(strict)}].function.strict=true {STRUCTURED}", param="tools", code="unsupported")
    if not tools:
        if choice != "none" and choice != "auto":
            raise APIError(400, "tool_choice 'required' or a named function needs tools", param="tool_choice", code="invalid_value")
        if req.parallel_tool_calls is not None:
            raise APIError(400, "parallel_tool_calls is only allowed when tools are specified", param="parallel_tool_calls", code="invalid_value")
        return ToolPlan(fmt)
    if choice == "none":
        return ToolPlan(fmt, parallel=req.parallel_tool_calls is not False)
    if fmt is None or not template_uses_tools:
        why = "does not render tools" if not template_uses_tools else "writes tool calls in a format this server does not parse"
        raise APIError(400, f"tools are not supported for this model: its chat template {why} (use tool_choice 'none')", param="tools", code="unsupported")
    forced = None
    if isinstance(choice, NamedToolChoice):
        forced = choice.function.name
        if forced not in names:
            raise APIError(400, f"tool_choice names {forced!r}, which is not among tools ({', '.join(names)})", param="tool_choice", code="invalid_value")
    elif choice == "required":
        if len(tools) > 1:
            message = f"tool_choice 'required' with {len(tools)} tools {STRUCTURED}: name the function, or pass one tool"
            raise APIError(400, message, param="tool_choice", code="unsupported")
        forced = names[0]
    return ToolPlan(fmt, tools, frozenset(names), forced, req.parallel_tool_calls is not False)

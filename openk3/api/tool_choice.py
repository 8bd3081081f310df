"""What a chat request asks of tools, checked against what the server can honour: `tools`, `tool_choice`,
`parallel_tool_calls`, and the chat format that decides how calls are written (api/chat_format.py).

- "none": the tools are not shown to the template (so the model is not invited to call them) and nothing is parsed as a
  call: any section the model still writes is plain content.
- "auto" (the default with tools): the template gets the tools; complete, valid calls are parsed out of the reply.
- named (`{"type": "function", "function": {"name": N}}`), and "required" with exactly one tool (the same thing): the start
  of the call is written into the prompt (the open blocks closed, the tool section opened, the call header up to its
  arguments: `chat_format.forced_call_prefix`) and a grammar (`ToolPlan.call_grammar`) makes the reply the arguments of N,
  matching its `parameters` schema, and the call's end. A schema the K3 argument grammar cannot express (an argument without
  one JSON type) leaves the arguments free, as before -- unless the tool is `strict`, which is then a 400.
- "required" with several tools: the prompt opens the tool section (`required_call_prefix`) and the grammar picks one of
  the tools' call headers, then that tool's arguments: exactly one call.
- `strict: true`: honoured by the grammar of named and required calls; with "auto" by a triggered grammar
  (`ToolPlan.call_grammar`): the reply is free text until it opens the tool section (K2 `<|tool_calls_section_begin|>`,
  K3 `<|open|>tools<|sep|>`), and from there one or more calls of the offered tools, each strict tool's arguments matching
  its schema (a non-strict tool's: any JSON object in K2, its argument blocks where they can be expressed in K3, else free
  text), up to the section's end; a call header outside a section cannot be written.
- `parallel_tool_calls: false`: enforced by stopping at the end of the first call.

`ToolPlan` is the seam between the parsers and the grammar engine: it names the chat format, the tools the reply may call
and the one it must call, and builds the structural tag (serve/structured) of the enforced call.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from openk3.api import chat_format as f
from openk3.api.chat_format import CALL_MARKUP, ChatFormat, PromptEnd
from openk3.api.errors import APIError
from openk3.api.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from openk3.api.tool_schemas import check_tool_schemas
from openk3.serve.structured.spec import StructuredOutputs, dump_json

K3_STRING = "[^<]*"  # a K3 string argument is raw text up to its close marker; an enforced one holds no '<'
K3_TYPES = {"string": "string", "integer": "number", "number": "number", "boolean": "boolean", "null": "null", "object": "object", "array": "array"}


class Unexpressible(ValueError):
    """A parameters schema the K3 argument grammar cannot express."""


def _const(value: str) -> dict[str, Any]:
    return {"type": "const_string", "value": value}


@dataclass(frozen=True)
class Spelling:
    """How an enforced call writes the format's own text (never a caller's value): each marker the tokenizer has as a
    special token (`markers`, name -> id) as that one token, and, with `encode`, the text between markers as the token ids
    the prompt encoder gives it, each piece on its own, as K3's encoding encodes its segments. A forced call then costs
    the tokens the model was trained to write, and the grammar cannot spell a marker out byte by byte. `Spelling()` writes
    the format as text, in any tokenization (a tokenizer without the markers)."""

    markers: Mapping[str, int] = field(default_factory=dict)
    encode: Callable[[str], list[int]] | None = None

    def pieces(self, *parts: str | Marker) -> list[dict[str, Any]]:
        """Formats for `parts` in order: a Marker is a format marker, a str is text (which may hold a caller's key or name,
        never read as a marker)."""
        out: list[dict[str, Any]] = []
        for part in parts:
            if isinstance(part, Marker) and part.text in self.markers:
                out.append({"type": "token", "token": self.markers[part.text]})
            elif self.encode is not None:
                out.extend({"type": "token", "token": i} for i in self.encode(str(part)))
            elif str(part):
                out.append(_const(str(part)))
        return out

    def constant(self, value: str) -> list[dict[str, Any]]:
        """A constant of the format (chat_format's, no caller text in it), its markers found by name."""
        names = sorted(set(self.markers) | MARKERS, key=len, reverse=True)
        split = re.split("(" + "|".join(re.escape(m) for m in names) + ")", value)
        return self.pieces(*(Marker(p) if p in names else p for p in split if p))


class Marker(NamedTuple):
    text: str

    def __str__(self) -> str:
        return self.text


MARKERS = frozenset().union(*CALL_MARKUP.values())


def _json(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": schema, "style": "json"}


def _k3_value(key: str, schema: Any) -> tuple[str, dict[str, Any]]:
    """The `type` attribute and the value format of one K3 argument."""
    if not isinstance(schema, dict):
        raise Unexpressible(f"properties.{key} is not a schema object")
    enum = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if enum is not None and enum and all(isinstance(v, str) for v in enum):
        return "string", {"type": "or", "elements": [_const(v) for v in enum]}
    kind = schema.get("type")
    if kind is None and enum:
        kinds = {"boolean" if isinstance(v, bool) else "number" if isinstance(v, (int, float)) else "null" if v is None else "" for v in enum}
        kind = kinds.pop() if len(kinds) == 1 and "" not in kinds else None
    if not isinstance(kind, str) or kind not in K3_TYPES:
        raise Unexpressible(f"properties.{key} needs exactly one JSON type, got {kind!r}")
    if kind == "string":
        if "pattern" in schema:
            return "string", {"type": "regex", "pattern": schema["pattern"]}
        low, high = schema.get("minLength"), schema.get("maxLength")
        if low is None and high is None:
            return "string", {"type": "regex", "pattern": K3_STRING}
        return "string", {"type": "regex", "pattern": f"[^<]{{{low or 0},{'' if high is None else high}}}"}
    return K3_TYPES[kind], _json(schema)


def _k3_arguments(parameters: dict[str, Any] | None, spell: Spelling) -> list[dict[str, Any]]:
    """K3 argument blocks for a parameters schema: its properties in order, the required ones always, the others optional."""
    props = (parameters or {}).get("properties") or {}
    required = set((parameters or {}).get("required") or ())
    if not required <= set(props):
        raise Unexpressible(f"required names {sorted(required - set(props))}, which properties do not declare")
    out = []
    for key, schema in props.items():
        attr, value = _k3_value(key, schema)
        head = spell.pieces(Marker(f.OPEN), f'argument key="{key}" type="{attr}"', Marker(f.SEP))  # the key is the caller's
        block = {"type": "sequence", "elements": [*head, value, *spell.constant(f.K3_ARG_CLOSE)]}
        out.append(block if key in required else {"type": "optional", "content": block})
    return out


def _arguments(fmt: ChatFormat, tool: Tool, spell: Spelling) -> list[dict[str, Any]]:
    params = tool.function.parameters
    if fmt is ChatFormat.KIMI_K2:
        return [_json(params if params is not None else {"type": "object", "properties": {}})]
    return _k3_arguments(params, spell)


def _header(fmt: ChatFormat, name: str, index: int, spell: Spelling) -> list[dict[str, Any]]:
    if fmt is ChatFormat.KIMI_K2:
        return spell.pieces(Marker(f.CALL_BEGIN), f"functions.{name}:{index}", Marker(f.ARGS_BEGIN))
    return spell.pieces(Marker(f.OPEN), f'call tool="{name}" index="1"', Marker(f.SEP))


def _section_end(fmt: ChatFormat, spell: Spelling) -> list[dict[str, Any]]:
    ends = (f.CALL_END, f.SECTION_END) if fmt is ChatFormat.KIMI_K2 else (f.K3_CALL_CLOSE, f.K3_TOOLS_CLOSE, f.K3_MESSAGE_CLOSE)
    return [x for end in ends for x in spell.constant(end)]


@dataclass(frozen=True)
class ToolPlan:
    fmt: ChatFormat | None  # None: the template writes no format the server parses (no reasoning or tool parsing)
    tools: tuple[Tool, ...] = ()  # shown to the template
    tool_names: frozenset[str] | None = None  # the names a parsed call may have; None: nothing is parsed as a call
    forced: str | None = None  # the function the reply must call
    parallel: bool = True
    required: bool = False  # "required" over several tools: the grammar picks the call
    strict_auto: bool = False  # "auto" with a strict tool: the grammar lets the reply be text or schema-valid calls

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def call_stop(self) -> str | None:
        """The stop string that ends the reply after its first call (parallel_tool_calls false)."""
        if self.parallel or self.fmt is None or self.tool_names is None:
            return None
        return f.CALL_END if self.fmt is ChatFormat.KIMI_K2 else f.K3_CALL_CLOSE

    def call_grammar(self, index: int, spell: Spelling | None = None) -> StructuredOutputs | None:
        """The structural tag of the enforced call (`index`: K2's conversation-wide call index), or None when the call is not
        enforced or, for a non-strict named tool, its schema cannot be expressed (its arguments are then the model's own).
        With "auto" and a strict tool: free text or a section of schema-valid calls (`_auto_grammar`). `spell`: how the
        format's own text is written (Spelling; text in any tokenization when None)."""
        spell = spell or Spelling()
        if self.fmt is None or (self.forced is None and not self.required):
            return self._auto_grammar(spell) if self.fmt is not None and self.strict_auto else None
        fmt = self.fmt
        tools = [t for t in self.tools if self.forced is None or t.function.name == self.forced]
        try:
            if self.forced is not None:
                elements = _arguments(fmt, tools[0], spell) + _section_end(fmt, spell)
            else:
                calls = [{"type": "sequence", "elements": [*_header(fmt, t.function.name, index, spell), *_arguments(fmt, t, spell)]} for t in tools]
                elements = [{"type": "or", "elements": calls}, *_section_end(fmt, spell)]
        except Unexpressible as e:
            if self.forced is not None and not tools[0].function.strict:
                return None
            i = next(k for k, t in enumerate(self.tools) if t.function.name in {x.function.name for x in tools})
            raise _unexpressible(i, e) from e
        return StructuredOutputs(structural_tag=dump_json({"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}))

    def _auto_grammar(self, spell: Spelling) -> StructuredOutputs:
        assert self.fmt is not None
        k2 = self.fmt is ChatFormat.KIMI_K2
        tags = []
        for i, t in enumerate(self.tools):
            strict = bool(t.function.strict)
            try:
                args = _arguments(self.fmt, t, spell) if strict or not k2 else [_json({"type": "object"})]
            except Unexpressible as e:
                if strict:
                    raise _unexpressible(i, e) from e
                args = [{"type": "any_text", "excludes": [f.K3_CALL_CLOSE, f.K3_TOOLS_CLOSE]}]
            name = t.function.name
            begin = f"{f.CALL_BEGIN}functions.{name}:" if k2 else f'{f.K3_CALL_OPEN} tool="{name}" index="'
            head = [_regex("[0-9]+"), _const(f.ARGS_BEGIN if k2 else '"' + f.SEP)]
            tags.append({"type": "tag", "begin": begin, "content": {"type": "sequence", "elements": head + args}, "end": f.CALL_END if k2 else f.K3_CALL_CLOSE})
        opened, closed = (f.SECTION_BEGIN, f.SECTION_END) if k2 else (f.K3_TOOLS_OPEN, f.K3_TOOLS_CLOSE)
        calls = {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True, "stop_after_first": not self.parallel}
        section = {"type": "tag", "begin": opened, "content": calls, "end": closed}
        outside = [f.CALL_BEGIN] if k2 else [f.K3_CALL_OPEN]  # a call written outside the section would escape the grammar
        fmt = {"type": "triggered_tags", "triggers": [opened], "tags": [section], "excludes": outside}
        return StructuredOutputs(structural_tag=dump_json({"type": "structural_tag", "format": fmt}))


def _regex(pattern: str) -> dict[str, Any]:
    return {"type": "regex", "pattern": pattern}


def _unexpressible(i: int, e: Unexpressible) -> APIError:
    return APIError(400, f"tools[{i}].function.parameters: {e}, which a K3 call grammar cannot enforce", param="tools", code="unsupported")


def required_call_prefix(fmt: ChatFormat, end: PromptEnd) -> str:
    """The prompt's end for "required" over several tools: the open blocks closed and the tool section opened; the
    grammar writes the call header."""
    if fmt is ChatFormat.KIMI_K3:
        head = f.K3_THINK_CLOSE + f.K3_RESPONSE_OPEN + f.K3_RESPONSE_CLOSE if end.in_reasoning else f.K3_RESPONSE_CLOSE if end.in_response else ""
        return head + f.K3_TOOLS_OPEN
    return (f.THINK_CLOSE if end.in_reasoning else "") + f.SECTION_BEGIN


def structured_reply_prefix(fmt: ChatFormat, end: PromptEnd) -> str:
    """What is appended to the prompt of a request with structured output, so that the grammar's text is the answer: the
    reasoning block closed (skipped, as for a forced call) and, in K3, the response block opened."""
    if fmt is ChatFormat.KIMI_K3:
        return f.K3_THINK_CLOSE + f.K3_RESPONSE_OPEN if end.in_reasoning else ""
    return f.THINK_CLOSE if end.in_reasoning else ""


def _structured_field(req: ChatCompletionRequest) -> str | None:
    if req.response_format is not None and req.response_format.type != "text":
        return "response_format"
    return next((n for n in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar") if getattr(req, n) is not None), None)


def plan_tools(req: ChatCompletionRequest, fmt: ChatFormat | None, template_uses_tools: bool) -> ToolPlan:
    tools = tuple(req.tools or ())
    check_tool_schemas(tools)
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"tools names {dup!r} twice: tool names must be unique", param="tools", code="invalid_value")
    strict = next((t.function.name for t in tools if t.function.strict), None)
    if not tools:
        if choice != "none" and choice != "auto":
            raise APIError(400, "tool_choice 'required' or a named function needs tools", param="tool_choice", code="invalid_value")
        if req.parallel_tool_calls is not None:
            raise APIError(400, "parallel_tool_calls is only allowed when tools are specified", param="parallel_tool_calls", code="invalid_value")
        return ToolPlan(fmt)
    if choice == "none":
        return ToolPlan(fmt, parallel=req.parallel_tool_calls is not False)
    structured = _structured_field(req)
    if structured is not None:
        message = f"{structured} with tools is not supported: the reply is either a call or the structured answer (use tool_choice 'none')"
        raise APIError(400, message, param=structured, code="unsupported")
    if fmt is None or not template_uses_tools:
        why = "does not render tools" if not template_uses_tools else "writes tool calls in a format this server does not parse"
        raise APIError(400, f"tools are not supported for this model: its chat template {why} (use tool_choice 'none')", param="tools", code="unsupported")
    forced = None
    if isinstance(choice, NamedToolChoice):
        forced = choice.function.name
        if forced not in names:
            raise APIError(400, f"tool_choice names {forced!r}, which is not among tools ({', '.join(names)})", param="tool_choice", code="invalid_value")
    elif choice == "required" and len(tools) == 1:
        forced = names[0]
    required = choice == "required" and forced is None
    strict_auto = choice == "auto" and strict is not None
    return ToolPlan(fmt, tools, frozenset(names), forced, req.parallel_tool_calls is not False, required=required, strict_auto=strict_auto)

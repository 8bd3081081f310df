"""Kimi K3's prompt encoding (XTML), in Python as the release ships it (its `encoding_k3.py`; K3 has no Jinja template).

Written for openk3 from the published format; tests/api/test_k3_encoding.py holds it byte for byte to renderings of the
published file (tests/api/data/k3_encoding_reference.json, which records where that file came from). A prompt is a list of
segments: control segments are K3's special tokens (`<|open|>`, `<|sep|>`, `<|close|>`, `<|end_of_msg|>`), every other
segment is text -- tag names, attributes, message content -- which is never read as a special token, and which the
release's tokenizer encodes segment by segment (each one its own BPE run).

The layout, in order: a `tool-declare` system message when tools are declared (compact JSON, keys sorted at every depth);
a `thinking-effort` system message when thinking (effort `max` unless asked otherwise); the messages
(`<|open|>message role="R" [name="N"]<|sep|>...<|close|>message<|sep|><|end_of_msg|>`; an assistant turn holds
`think` (only when thinking, empty when it had no reasoning), `response` and, with calls, a `tools` block of
`call tool="NAME" index="i"` blocks with one typed `argument` block per key, or one `json` block when the arguments are
not a JSON object; a tool result is `role="tool" tool="NAME" index="i"`, results put in call order); then a `tool-choice`
system message for `required` / `none` and a `response-format` one for JSON mode; then the generation prompt, which opens
the assistant message and its `think` (thinking) or `response` block. Attribute values escape `&` and `"`.
An image part is `<|media_begin|>image WxH<|media_content|><|media_pad|><|media_end|>`, as the release's kimi_k3
processor writes it into the prompt (W x H the size sent).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, NamedTuple

from openk3.serve.media_prompt import MEDIA_BEGIN, MEDIA_CONTENT, MEDIA_END, MEDIA_PAD

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
EFFORTS = ("low", "high", "max")  # what the published encoding accepts; its own text also names `medium`, which it refuses
DEFAULT_EFFORT = "max"
KWARGS = frozenset({"thinking", "enable_thinking", "thinking_effort", "reasoning_effort"})  # what chat_template_kwargs may set


class Segment(NamedTuple):
    text: str
    control: bool  # a K3 special token; otherwise text, never read as one


@dataclass(frozen=True)
class K3Options:
    thinking: bool = True
    effort: str = DEFAULT_EFFORT
    tool_choice: str | None = None  # "required" / "none" get a system message; "auto" and a named call none
    response_format: dict[str, Any] | None = None  # {"type": ..., "json_schema": {...}} as the request sent it


def k3_options(kwargs: dict[str, Any], reasoning_effort: str | None, tool_choice: str | None, response_format: dict[str, Any] | None) -> K3Options:
    """The options of one request, from its chat_template_kwargs (`thinking`, vLLM's `enable_thinking`, `thinking_effort`,
    `reasoning_effort`) and its `reasoning_effort` field: `none` turns thinking off; an explicit `thinking_effort` wins over
    `reasoning_effort`, as in the published encoding. ValueError names what is refused."""
    unknown = sorted(set(kwargs) - KWARGS)
    if unknown:
        raise ValueError(f"chat_template_kwargs.{unknown[0]} is not read by Kimi K3's encoding; it reads: {', '.join(sorted(KWARGS))}")
    for key in ("thinking", "enable_thinking"):
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise ValueError(f"chat_template_kwargs.{key} must be true or false, got {kwargs[key]!r}")
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking", True))
    effort_asked = kwargs.get("reasoning_effort", reasoning_effort)
    effort = kwargs.get("thinking_effort")
    if effort_asked == "none":
        thinking = False
    elif effort is None:
        effort = effort_asked
    effort = DEFAULT_EFFORT if effort is None else effort
    if effort not in EFFORTS:
        raise ValueError(f"reasoning effort {effort!r} is not one Kimi K3 supports: {', '.join(EFFORTS)}, or none (thinking off)")
    return K3Options(thinking, effort, tool_choice, response_format)


def _control(text: str) -> list[Segment]:
    return [Segment(text, True)]


def _text(text: str) -> list[Segment]:
    return [Segment(text, False)] if text else []  # an empty piece is no segment: it would be no token either


def _open(tag: str, attrs: tuple[tuple[str, Any], ...] = ()) -> list[Segment]:
    out = _control(OPEN) + _text(tag)
    for key, value in attrs:  # key, `="`, value and `"` are separate pieces, as the release tokenizes them
        out += _text(f" {key}") + _text('="') + _text(str(value).replace("&", "&amp;").replace('"', "&quot;")) + _text('"')
    return out + _control(SEP)


def _close(tag: str) -> list[Segment]:
    return _control(CLOSE) + _text(tag) + _control(SEP)


def _message(attrs: tuple[tuple[str, Any], ...], body: list[Segment]) -> list[Segment]:
    return _open("message", attrs) + body + _close("message") + _control(END_OF_MSG)


def _system(kind: str, body: str) -> list[Segment]:
    return _message((("role", "system"), ("type", kind)), _text(body.strip()))


def _compact(value: Any) -> str:
    return json.dumps(sort_keys_deep(value), ensure_ascii=False, separators=(",", ":"))


def sort_keys_deep(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: sort_keys_deep(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [sort_keys_deep(v) for v in value]
    return value


class MediaPart(NamedTuple):
    """An image among a message's parts, by the size it was sent at (the release's processor writes it into the marker)."""

    width: int
    height: int


def _media(part: MediaPart) -> list[Segment]:
    """K3's image marker: one `<|media_pad|>`, which the processor repeats to the image's token count (serve/media_prompt.py)."""
    return _control(MEDIA_BEGIN) + _text(f"image {part.width}x{part.height}") + _control(MEDIA_CONTENT) + _control(MEDIA_PAD) + _control(MEDIA_END)


def _content(content: str | list[str | MediaPart]) -> list[Segment]:
    """A message's content: a string, or its parts, each text part its own segment, each image its marker."""
    return [s for part in ([content] if isinstance(content, str) else content) for s in (_media(part) if isinstance(part, MediaPart) else _text(part))]


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


def _call(index: int, call: dict[str, Any]) -> list[Segment]:
    fn = call["function"]
    out = _open("call", (("tool", fn["name"]), ("index", index)))
    args = _arguments(fn["arguments"], fn["name"])
    if isinstance(args, str):  # not JSON: the text goes back as it was sent, in a json block
        out += _open("json", (("type", "object"),)) + _text(args) + _close("json")
    else:
        for key, value in args.items():
            rendered = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            out += _open("argument", (("key", key), ("type", _type_name(value)))) + _text(rendered) + _close("argument")
    return out + _close("call")


def _arguments(args: dict[str, Any] | str, name: str) -> dict[str, Any] | str:
    """A call's arguments: a dict, no text at all (no arguments), or text that is not JSON; other JSON is refused."""
    if isinstance(args, dict) or not args.strip():
        return args or {}
    try:
        json.loads(args)
    except ValueError:
        return args
    raise ValueError(f"the arguments of a {name} call are JSON but not an object: Kimi K3 writes a call's arguments as an object")


def _assistant(m: dict[str, Any], thinking: bool) -> list[Segment]:
    out: list[Segment] = []
    if thinking:  # the think block is part of every assistant turn while thinking, empty or not
        reasoning = m.get("reasoning_content") or ""
        out += _open("think") + (_text(reasoning) if reasoning.strip() else []) + _close("think")
    out += _open("response") + _content(m["content"]) + _close("response")
    if m.get("tool_calls"):
        out += _open("tools") + [s for i, call in enumerate(m["tool_calls"], start=1) for s in _call(i, call)] + _close("tools")
    return out


def _named(role: str, m: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return (("role", role),) + ((("name", m["name"]),) if m.get("name") else ())


def _in_call_order(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of tool results put in the order of the calls they answer (by tool_call_id) when every result of the run
    answers a call of the assistant turn before it; a run that does not is kept as sent."""
    out: list[dict[str, Any]] = []
    positions: dict[str, int] = {}
    i = 0
    while i < len(messages):
        if messages[i]["role"] != "tool":
            if messages[i]["role"] == "assistant":
                positions = {}
                for p, call in enumerate(messages[i].get("tool_calls") or (), start=1):
                    positions.setdefault(call["id"], p)
            out.append(messages[i])
            i += 1
            continue
        j = i
        while j < len(messages) and messages[j]["role"] == "tool":
            j += 1
        run = messages[i:j]
        if all(m.get("tool_call_id") in positions for m in run):
            run = sorted(run, key=lambda m: positions[m["tool_call_id"]])  # sorted() is stable: repeated ids keep their order
        out += run
        i = j
    return out


def k3_segments(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, options: K3Options, add_generation_prompt: bool) -> list[Segment]:
    """The prompt of `messages` (as api/chat.py's message_dicts gives them: tool results carry their tool's `name`, call
    arguments are a dict, or the string sent when it is not a JSON object; content is a string or a list of part texts)."""
    out: list[Segment] = []
    if tools:
        body = f"# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{_compact(tools)}\n```"
        out += _message((("role", "system"), ("type", "tool-declare")), _text(body))
    if options.thinking:
        out += _system(
            "thinking-effort",
            "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
            f"supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort={options.effort}`.",
        )
    result_index = 0
    for m in _in_call_order(messages):
        role = m["role"]
        if role == "tool":
            result_index += 1
            out += _message((("role", "tool"), ("tool", m["name"]), ("index", result_index)), _content(m["content"]))
        elif role == "assistant":
            result_index = 0
            out += _message(_named(role, m), _assistant(m, options.thinking))
        else:
            out += _message(_named(role, m), _content(m["content"]))
    if options.tool_choice in ("required", "none"):
        must = "call tools" if options.tool_choice == "required" else "NOT call any tools"
        out += _system("tool-choice", f"The system is invoked with `tool_choice={options.tool_choice}`.\nYou MUST {must} in the next message.")
    out += _response_format(options.response_format)
    if add_generation_prompt:
        out += _open("message", (("role", "assistant"),)) + _open("think" if options.thinking else "response")
    return out


def _response_format(response_format: dict[str, Any] | None) -> list[Segment]:
    kind = (response_format or {}).get("type")
    head = (
        f"The system is invoked with `response_format={kind}`.\n"
        "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
    )
    if kind == "json_object":
        return _system("response-format", head)
    if kind == "json_schema":
        spec = (response_format or {}).get("json_schema") or {}
        schema = spec.get("schema", spec.get("json_schema", spec))  # as the published encoding reads it
        return _system("response-format", f"{head}\nThe JSON data must match the following schema:\n```json\n{_compact(schema)}\n```")
    return []

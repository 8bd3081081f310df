"""Chat templates: messages -> prompt text, with the Jinja template that ships with the model (as Hugging Face checkpoints do).
K3 ships its prompt encoding in Python instead (api/chat_k3.py renders it); api/chat_loading.py picks one for a folder.
The template gets what Hugging Face templates expect: `messages` (with assistant `tool_calls` -- arguments as a dict when they
are a JSON object, as vLLM hands them over --, `tool` turns with `tool_call_id` and the called tool's `name`, earlier turns'
`reasoning_content`), `tools`, `add_generation_prompt`, `bos_token`, `eos_token`, and the request's `chat_template_kwargs`
(e.g. `thinking`), each of which must be a variable the template reads: a kwarg it never reads is a 400, not ignored.
A reply must end where the template ends a turn: every end-of-turn marker the template writes (`<|im_end|>`, K3's
`<|end_of_msg|>` and the like) becomes a stop token when the tokenizer has it as one special token, else a stop string (a
byte tokenizer spells it out). Checkpoints also name their end tokens in `generation_config.json`, which every request stops
at, as in vLLM (serve/generation_config.py reads it).
Templates render in Jinja's immutable sandbox: a checkpoint's template is data, not code we trust. Request text is rendered with
its special-token strings hidden (`render_prompt`, api/user_text.py), so that a marker in a message stays text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from openk3.api.chat_format import ChatFormat, detect_format
from openk3.api.protocol import ChatMessage
from openk3.api.user_text import PromptText, UserText
from openk3.serve.tokenizer import Tokenizer

CHATML_END = "<|im_end|>"
END_OF_TURN_MARKERS = (CHATML_END, "<|end_of_msg|>", "<|eot_id|>", "<|end|>")
RESERVED = ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception")
DEFAULT_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ChatOptions:
    """The request fields a prompt may depend on beyond its messages and tools (K3's encoding writes each of them into the
    prompt; a Jinja template gets `reasoning_effort` when it reads it)."""

    reasoning_effort: str | None = None
    tool_choice: str | None = None  # "auto" / "none" / "required"; a named choice is None here
    response_format: dict[str, Any] | None = None
    image_sizes: tuple[tuple[int, int], ...] = ()  # (width, height) of each image part in order: K3's encoding writes them


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    """Hugging Face's `tojson`: plain json.dumps (Jinja's own escapes <, > and & for HTML, which would change the prompt)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class PromptRenderer:
    """What both chat renderers share (this module's Jinja ChatTemplate, chat_k3.py's K3Template): the stops at the end of
    a turn and the prompt as plain text; each defines `end_of_turn_markers` and `render_prompt`."""

    end_of_turn_markers: tuple[str, ...]

    def render_prompt(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        special_tokens: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        markers: Iterable[str] = (),
        options: ChatOptions | None = None,
    ) -> PromptText:
        raise NotImplementedError  # each renderer's own

    def stops(self, tokenizer: Tokenizer) -> tuple[tuple[str, ...], tuple[int, ...]]:
        return turn_stops(self.end_of_turn_markers, tokenizer)

    def render(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        special_tokens: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        options: ChatOptions | None = None,
    ) -> str:
        return self.render_prompt(messages, add_generation_prompt, special_tokens, extra, tools, (), options).text


class ChatTemplate(PromptRenderer):
    """A compiled chat template; `render` raises ValueError (an HTTP 400) for messages it cannot render."""

    def __init__(self, source: str, origin: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        env.filters["tojson"] = _tojson
        try:
            self._template = env.from_string(source)
            self.variables = frozenset(meta.find_undeclared_variables(env.parse(source)))
        except TemplateError as e:
            raise ValueError(f"chat template from {origin} does not compile: {e}") from e
        self.source = source
        self.origin = origin
        self.end_of_turn_markers = tuple(m for m in END_OF_TURN_MARKERS if m in source)
        self.format: ChatFormat | None = detect_format(source)

    @property
    def end_of_turn(self) -> str | None:
        return self.end_of_turn_markers[0] if self.end_of_turn_markers else None

    @property
    def uses_tools(self) -> bool:
        return "tools" in self.variables

    def check_kwargs(self, kwargs: dict[str, Any] | None) -> None:
        """ValueError naming a chat_template_kwargs key the template does not read (or one the server sets itself)."""
        for key in kwargs or {}:
            if key in RESERVED:
                raise ValueError(f"chat_template_kwargs.{key} is set by the server: pass it as a request field, not a template kwarg")
            if key not in self.variables:
                known = ", ".join(sorted(self.variables - set(RESERVED))) or "none"
                raise ValueError(f"chat_template_kwargs.{key} is not read by the chat template ({self.origin}); it reads: {known}")

    def check_effort(self, effort: str, kwargs: dict[str, Any] | None) -> None:
        """ValueError unless the template reads `reasoning_effort` (it gets the request's field as that variable)."""
        if "reasoning_effort" not in self.variables:
            raise ValueError(f"reasoning_effort={effort!r} is not supported: the chat template ({self.origin}) does not read reasoning_effort")

    @staticmethod
    def default() -> ChatTemplate:
        return ChatTemplate(DEFAULT_CHATML, "the built-in ChatML default")

    def render_prompt(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        special_tokens: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        markers: Iterable[str] = (),
        options: ChatOptions | None = None,
    ) -> PromptText:
        """The prompt, and where in it request text holds one of `markers` (the tokenizer's special-token strings), which
        must stay text (api/user_text.py); the template's own markers and `special_tokens` are not request text."""
        user = UserText(markers)
        context = user.hide(dict(extra or {}))
        effort = None if options is None else options.reasoning_effort
        if effort is not None:
            self.check_effort(effort, extra)
            context.setdefault("reasoning_effort", effort)
        context.update(special_tokens or {})
        dicts = [{**user.hide(d), "role": d["role"]} for d in message_dicts(messages)]  # roles are the server's checked names
        context.update(messages=dicts, add_generation_prompt=add_generation_prompt, tools=user.hide(tools))
        try:
            return user.reveal(self._template.render(**context))
        except TemplateError as e:
            raise ValueError(f"messages could not be rendered with the chat template ({self.origin}): {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"messages could not be rendered with the chat template ({self.origin}): {type(e).__name__}: {e}") from e


def turn_stops(markers: Iterable[str], tokenizer: Tokenizer) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(stop strings, stop token ids) that end a reply at the ends of turn `markers`: a marker the tokenizer has as one
    special token is a stop id, else (a byte tokenizer spells it out) a stop string."""
    strings, ids = [], []
    for marker in markers:
        encoded = tokenizer.encode(marker, add_special_tokens=False)
        if len(encoded) == 1 and tokenizer.decode(encoded, skip_special_tokens=True) == "":
            ids.append(encoded[0])
        else:
            strings.append(marker)
    return tuple(strings), tuple(ids)


def message_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as templates expect them; a tool turn also gets the name of the call it answers."""
    names: dict[str, str] = {}
    out = []
    for i, m in enumerate(messages):
        d = message_dict(m, i)
        for call in m.tool_calls or ():
            names[call.id] = call.function.name
        if m.role == "tool" and m.tool_call_id is not None and "name" not in d:
            if m.tool_call_id not in names:
                raise ValueError(f"messages[{i}].tool_call_id {m.tool_call_id!r} answers no tool call of an earlier assistant message")
            d["name"] = names[m.tool_call_id]
        out.append(d)
    return out


def message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as templates expect it: content flattened to one string (text parts only)."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise ValueError(f"messages[{index}].content[{j}] has type {part.type!r}: only 'text' parts with a 'text' field are supported")
            if part.model_extra:
                raise ValueError(f"messages[{index}].content[{j}].{sorted(part.model_extra)[0]} is not supported: a text part has only type and text")
            texts.append(part.text)
        content = "".join(texts)
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls is not None:
        if message.role != "assistant":
            raise ValueError(f"messages[{index}].tool_calls: only assistant messages make tool calls")
        out["tool_calls"] = [_call_dict(c.id, c.function.name, c.function.arguments) for c in message.tool_calls]
    if message.tool_call_id is not None:
        if message.role != "tool":
            raise ValueError(f"messages[{index}].tool_call_id: only tool messages answer a tool call")
        out["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning_content if message.reasoning_content is not None else message.reasoning
    if reasoning is not None:
        if message.role != "assistant":
            raise ValueError(f"messages[{index}].reasoning_content: only assistant messages have reasoning")
        out["reasoning_content"] = reasoning
    return out


def _call_dict(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        parsed: Any = json.loads(arguments)
    except ValueError:
        parsed = None
    args = parsed if isinstance(parsed, dict) else arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}

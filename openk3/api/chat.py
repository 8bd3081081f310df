"""Chat templates: messages -> prompt text, with the Jinja template that ships with the model (as Hugging Face checkpoints do).

Where a template is found, in order: an explicit file, `chat_template.jinja` in the model folder, the `chat_template` entry of
its `tokenizer_config.json`. A model with none (the byte-tokenizer presets) gets a ChatML-style default.
A reply must end where the template ends a turn: the template's end-of-turn marker (`<|im_end|>` and the like) becomes a stop
token when the tokenizer has it as one special token, else a stop string (a byte tokenizer spells it out). Checkpoints also
name their end tokens in `generation_config.json` (`eos_token_id`, an id or a list), which every request stops at, as in vLLM.
Templates render in Jinja's immutable sandbox: a checkpoint's template is data, not code we trust.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from openk3.api.protocol import ChatMessage
from openk3.serve.tokenizer import Tokenizer

CHATML_END = "<|im_end|>"
END_OF_TURN_MARKERS = (CHATML_END, "<|eot_id|>", "<|end|>")
DEFAULT_CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    """A compiled chat template; `render` raises ValueError (an HTTP 400) for messages it cannot render."""

    def __init__(self, source: str, origin: str) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"chat template from {origin} does not compile: {e}") from e
        self.source = source
        self.origin = origin
        self.end_of_turn = next((m for m in END_OF_TURN_MARKERS if m in source), None)

    @staticmethod
    def default() -> ChatTemplate:
        return ChatTemplate(DEFAULT_CHATML, "the built-in ChatML default")

    def stops(self, tokenizer: Tokenizer) -> tuple[tuple[str, ...], tuple[int, ...]]:
        """(stop strings, stop token ids) that end a reply at the template's end of turn."""
        if self.end_of_turn is None:
            return (), ()
        ids = tokenizer.encode(self.end_of_turn, add_special_tokens=False)
        if len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == "":
            return (), (ids[0],)
        return (self.end_of_turn,), ()

    def render(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        special_tokens: dict[str, str] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        context = dict(extra or {})
        context.update(special_tokens or {})
        context.update(messages=[message_dict(m, i) for i, m in enumerate(messages)], add_generation_prompt=add_generation_prompt)
        try:
            return self._template.render(**context)
        except TemplateError as e:
            raise ValueError(f"messages could not be rendered with the chat template ({self.origin}): {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise ValueError(f"messages could not be rendered with the chat template ({self.origin}): {type(e).__name__}: {e}") from e


def message_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as templates expect it: content flattened to one string (text parts only)."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise ValueError(f"messages[{index}].content[{j}] has type {part.type!r}: only 'text' parts with a 'text' field are supported")
            texts.append(part.text)
        content = "".join(texts)
    out: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.name is not None:
        out["name"] = message.name
    return out


def _from_tokenizer_config(file: Path) -> str | None:
    try:
        entry = json.loads(file.read_text()).get("chat_template")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    if isinstance(entry, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, dict)}
        entry = named.get("default")
    return entry if isinstance(entry, str) else None


def load_chat_template(model_dir: Path | None, explicit: Path | None = None) -> ChatTemplate:
    """The model's own template when it ships one, else the ChatML default."""
    if explicit is not None:
        if not explicit.is_file():
            raise ValueError(f"--chat-template {explicit}: no such file")
        return ChatTemplate(explicit.read_text(), str(explicit))
    if model_dir is not None:
        jinja = model_dir / "chat_template.jinja"
        if jinja.is_file():
            return ChatTemplate(jinja.read_text(), str(jinja))
        config = model_dir / "tokenizer_config.json"
        source = _from_tokenizer_config(config) if config.is_file() else None
        if source is not None:
            return ChatTemplate(source, str(config))
    return ChatTemplate.default()


def generation_stop_ids(model_dir: Path | None) -> tuple[int, ...]:
    """The end tokens a checkpoint's generation_config.json names (eos_token_id: an id or a list), or none."""
    file = None if model_dir is None else model_dir / "generation_config.json"
    if file is None or not file.is_file():
        return ()
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError, AttributeError):
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    return tuple(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0)

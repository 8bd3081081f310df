"""The two Kimi output formats the server parses, told apart by the chat template that writes them.

- `kimi_k2` (Kimi K2, K2-Thinking, K2.5): turns end with `<|im_end|>`; reasoning is `<think>...</think>` at the start of a
  reply (opened by the model, or by the generation prompt when it ends with `<think>`); tool calls are one section,
  `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}
  <|tool_call_end|>`, then `<|tool_calls_section_end|>`. IDX counts the calls of the whole conversation, and the template
  writes each earlier call's id back into the prompt, so the id returned is the model's own `functions.NAME:IDX`.
- `kimi_k3` (Kimi K3, "XTML"): four special tokens `<|open|>`, `<|sep|>`, `<|close|>`, `<|end_of_msg|>`; a block is
  `<|open|>NAME attr="v"<|sep|>...<|close|>NAME<|sep|>`; a reply is `[think] response [tools] <|close|>message<|sep|>` and
  the turn ends with `<|end_of_msg|>`. The generation prompt opens the first block itself (`think` when thinking, else
  `response`). A call is `<|open|>call tool="NAME" index="N"<|sep|>` with typed arguments `<|open|>argument key="K"
  type="string|number|boolean|null|object|array"<|sep|>value<|close|>argument<|sep|>`. No id is written into the prompt
  (tool results name their tool), so ids are OpenAI-style `call_...`.

The markers are matched in decoded text, so the server decodes with special tokens kept whenever a format is parsed.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from enum import Enum


class ChatFormat(Enum):
    KIMI_K2 = "kimi_k2"
    KIMI_K3 = "kimi_k3"


def detect_format(source: str) -> ChatFormat | None:
    """The Kimi format a chat template writes, or None for templates whose output the server does not parse."""
    if "<|open|>" in source and "<|end_of_msg|>" in source:
        return ChatFormat.KIMI_K3
    if "<|tool_calls_section_begin|>" in source or ("<|im_middle|>" in source and "<think>" in source):
        return ChatFormat.KIMI_K2
    return None


# Kimi K2
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

# Kimi K3
OPEN, SEP, CLOSE = "<|open|>", "<|sep|>", "<|close|>"
K3_THINK_OPEN, K3_THINK_CLOSE = f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}"
K3_THINK_CLOSE_ELIDED = f"{CLOSE}think"  # after tool results K3 sometimes drops the <|sep|> of this close
K3_RESPONSE_OPEN, K3_RESPONSE_CLOSE = f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}"
K3_TOOLS_OPEN, K3_TOOLS_CLOSE = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
K3_CALL_OPEN, K3_CALL_CLOSE = f"{OPEN}call", f"{CLOSE}call{SEP}"
K3_ARG_OPEN, K3_ARG_CLOSE = f"{OPEN}argument", f"{CLOSE}argument{SEP}"
K3_MESSAGE_CLOSE = f"{CLOSE}message{SEP}"
K3_MARKERS = frozenset({OPEN, SEP, CLOSE, "<|end_of_msg|>"})  # K3's special tokens the parsers read

# the special tokens a tool-call grammar writes inside its markers: each is one token to the model, never spelled out
CALL_MARKUP = {ChatFormat.KIMI_K3: frozenset({OPEN, SEP, CLOSE}), ChatFormat.KIMI_K2: frozenset({SECTION_END, CALL_BEGIN, ARGS_BEGIN, CALL_END})}


@dataclass(frozen=True)
class PromptEnd:
    """Which block the generation prompt left open: the reply starts inside it."""

    in_reasoning: bool
    in_response: bool  # K3 only: the response block is open (thinking off)


def prompt_end(fmt: ChatFormat, prompt: str) -> PromptEnd:
    tail = prompt.rstrip()
    if fmt is ChatFormat.KIMI_K3:
        return PromptEnd(tail.endswith(K3_THINK_OPEN), tail.endswith(K3_RESPONSE_OPEN))
    return PromptEnd(tail.endswith(THINK_OPEN), False)


def forced_call_prefix(fmt: ChatFormat, end: PromptEnd, name: str, index: int) -> str:
    """What is appended to the prompt to force a call of `name` (tool_choice named): the open blocks closed (so the
    reasoning is skipped: there is no grammar yet to let the model think first and still force the call), the tool
    section opened and the call's header written up to its arguments. The parser reads it as the start of the reply."""
    if fmt is ChatFormat.KIMI_K3:
        head = ""
        if end.in_reasoning:
            head = K3_THINK_CLOSE + K3_RESPONSE_OPEN + K3_RESPONSE_CLOSE
        elif end.in_response:
            head = K3_RESPONSE_CLOSE
        return f'{head}{K3_TOOLS_OPEN}{K3_CALL_OPEN} tool="{name}" index="1"{SEP}'
    head = THINK_CLOSE if end.in_reasoning else ""
    return f"{head}{SECTION_BEGIN}{CALL_BEGIN}functions.{name}:{index}{ARGS_BEGIN}"


def call_id(fmt: ChatFormat, name: str, index: str) -> str:
    if fmt is ChatFormat.KIMI_K2:
        return f"functions.{name}:{index}"
    return f"call_{uuid.uuid4().hex[:24]}"

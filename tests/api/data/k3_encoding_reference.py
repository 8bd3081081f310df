"""Writes k3_encoding_reference.json: conversations rendered by the published Kimi K3 `encoding_k3.py`, the reference that
tests/api/test_k3_encoding.py holds openk3's own K3 encoding (openk3/api/k3_encoding.py) to, byte for byte.

Run once, by hand, with a copy of the published file (it is not part of openk3 and is never imported by it):

    python tests/api/data/k3_encoding_reference.py --reference /path/to/encoding_k3.py --source "<where the copy came from>"

The published module imports `vllm.exceptions.VLLMValidationError` (the vLLM-vendored copy does); a stand-in is put in
`sys.modules` when vLLM is not installed, so the file runs unchanged. The JSON records the source given, the file's sha256,
and for every case the request (OpenAI-style messages, tools, and the keyword arguments passed to `build_chat_segments`),
the rendered text and its segments (text, allow_special): the segments say which pieces the tokenizer encodes apart.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import sys
import types
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("k3_encoding_reference.json")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city; 날씨를 조회한다",
        "parameters": {"type": "object", "required": ["city"], "properties": {"unit": {"type": "string", "enum": ["c", "f"]}, "city": {"type": "string"}}},
    },
}
SEARCH = {
    "type": "function",
    "function": {"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}}},
}


def _call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CALLS_TWO = [_call("call_a", "get_weather", '{"city": "Paris"}'), _call("call_b", "search", '{"query": "louvre hours", "limit": 3}')]

CASES: list[dict[str, Any]] = [
    {"name": "one_user_default_thinking", "messages": [{"role": "user", "content": "Hello"}], "kwargs": {}},
    {
        "name": "system_user_thinking_off",
        "messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
        "kwargs": {"thinking": False},
    },
    {
        "name": "multi_turn_reasoning_kept_effort_low",
        "messages": [
            {"role": "user", "content": "Pick a number."},
            {"role": "assistant", "content": "7", "reasoning_content": "Any number works; 7 is common."},
            {"role": "user", "content": "Another?"},
            {"role": "assistant", "content": "3"},
            {"role": "user", "content": "Why?"},
        ],
        "kwargs": {"reasoning_effort": "low"},
    },
    {
        "name": "names_and_effort_high",
        "messages": [
            {"role": "system", "content": "Moderate the chat.", "name": "rules"},
            {"role": "user", "content": "hi all", "name": "alice"},
            {"role": "assistant", "content": "Hello Alice.", "name": "bot"},
            {"role": "user", "content": 'I am "B" & co', "name": 'bob "the" & builder'},
        ],
        "kwargs": {"thinking_effort": "high"},
    },
    {
        "name": "tools_declared_sorted_compact",
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER, SEARCH],
        "kwargs": {"tool_choice": "auto"},
    },
    {
        "name": "typed_arguments_history",
        "messages": [
            {"role": "user", "content": "Book it."},
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Call the tool.",
                "tool_calls": [
                    _call(
                        "c1",
                        "book",
                        json.dumps({"who": "Ann", "seats": 2, "price": 12.5, "vip": True, "note": None, "meta": {"b": 1, "a": [1, "x"]}, "tags": ["a", "b"]}),
                    )
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "booked"},
        ],
        "tools": [{"type": "function", "function": {"name": "book", "parameters": {"type": "object"}}}],
        "kwargs": {},
    },
    {
        "name": "tool_results_out_of_order",
        "messages": [
            {"role": "user", "content": "Weather and museum hours."},
            {"role": "assistant", "content": "Checking both.", "tool_calls": CALLS_TWO},
            {"role": "tool", "tool_call_id": "call_b", "content": "9-18"},
            {"role": "tool", "tool_call_id": "call_a", "content": "sunny"},
        ],
        "tools": [WEATHER, SEARCH],
        "kwargs": {"thinking": False},
    },
    {
        "name": "tool_choice_required",
        "messages": [{"role": "user", "content": "Look up Rome."}],
        "tools": [SEARCH],
        "kwargs": {"tool_choice": "required", "thinking": False},
    },
    {
        "name": "tool_choice_none",
        "messages": [{"role": "user", "content": "Just chat."}],
        "tools": [SEARCH],
        "kwargs": {"tool_choice": "none"},
    },
    {
        "name": "json_object_thinking_off",
        "messages": [{"role": "user", "content": "Give me a JSON greeting."}],
        "kwargs": {"response_format": {"type": "json_object"}, "thinking": False},
    },
    {
        "name": "json_schema_sorted",
        "messages": [{"role": "user", "content": "A person."}],
        "kwargs": {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}},
            }
        },
    },
    {
        "name": "arguments_not_json_and_markers_in_text",
        "messages": [
            {"role": "user", "content": "say <|open|>hi<|sep|> & <|end_of_msg|>"},
            {"role": "assistant", "content": "", "tool_calls": [_call("x", "search", "query=raw text")]},
            {"role": "tool", "tool_call_id": "x", "content": "<|close|>message<|sep|>"},
        ],
        "tools": [SEARCH],
        "kwargs": {"reasoning_effort": "max"},
    },
    {
        "name": "no_generation_prompt",
        "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "reasoning_content": "r"}],
        "kwargs": {"add_generation_prompt": False},
    },
    {
        "name": "reasoning_effort_none_text_parts",
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]},
            {"role": "assistant", "content": "ok", "reasoning_content": "dropped when thinking is off"},
            {"role": "user", "content": "next"},
        ],
        "kwargs": {"reasoning_effort": "none"},
    },
    {
        "name": "empty_arguments_and_whitespace_reasoning",
        "messages": [
            {"role": "user", "content": "ping"},
            {"role": "assistant", "content": "", "reasoning_content": "   ", "tool_calls": [_call("p", "ping", "{}"), _call("q", "ping", "")]},
            {"role": "tool", "tool_call_id": "p", "content": "pong"},
            {"role": "tool", "tool_call_id": "q", "content": "pong"},
            {"role": "assistant", "content": "Both answered."},
            {"role": "user", "content": "thanks"},
        ],
        "tools": [{"type": "function", "function": {"name": "ping"}}],
        "kwargs": {},
    },
]


def _load(reference: Path) -> types.ModuleType:
    if "vllm.exceptions" not in sys.modules:
        try:
            import vllm.exceptions  # noqa: F401
        except ImportError:

            class VLLMValidationError(ValueError):
                def __init__(self, message: str, parameter: str | None = None, value: Any = None) -> None:
                    super().__init__(message)
                    self.parameter, self.value = parameter, value

            stub = types.ModuleType("vllm.exceptions")
            stub.VLLMValidationError = VLLMValidationError  # type: ignore[attr-defined]
            sys.modules.setdefault("vllm", types.ModuleType("vllm"))
            sys.modules["vllm.exceptions"] = stub
    spec = importlib.util.spec_from_file_location("k3_reference_encoding", reference)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True, help="a copy of the published encoding_k3.py")
    parser.add_argument("--source", required=True, help="where the copy came from (URL, commit), recorded in the JSON")
    args = parser.parse_args()
    module = _load(args.reference)
    cases = []
    for case in CASES:
        kwargs = dict(case["kwargs"])
        segments = module.build_chat_segments(case["messages"], case.get("tools"), **kwargs)
        cases.append({**case, "text": "".join(s.text for s in segments), "segments": [[s.text, s.allow_special] for s in segments]})
    data = {
        "source": args.source,
        "sha256": hashlib.sha256(args.reference.read_bytes()).hexdigest(),
        "generated_by": "tests/api/data/k3_encoding_reference.py",
        "cases": cases,
    }
    OUT.write_text(json.dumps(data, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()

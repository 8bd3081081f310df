"""Reasoning apart from the answer, on exact texts: who opens the block, its close, the markers that end it implicitly,
a close cut across pieces, a reply cut inside it, thinking off."""

from __future__ import annotations

import pytest

from openk3.api.chat_format import ChatFormat, prompt_end
from openk3.api.reasoning import ReasoningSplitter


def split(fmt: ChatFormat, in_reasoning: bool, text: str, step: int | None = None) -> tuple[str, str]:
    s = ReasoningSplitter(fmt, in_reasoning)
    if step is None:
        return s.feed(text, final=True)
    r, a = "", ""
    pieces = [text[i : i + step] for i in range(0, len(text), step)] + [""]
    for i, piece in enumerate(pieces):
        got = s.feed(piece, final=i == len(pieces) - 1)
        r, a = r + got[0], a + got[1]
    return r, a


K2 = ChatFormat.KIMI_K2
K3 = ChatFormat.KIMI_K3
CASES = [
    ("k2 model opens", K2, False, "<think>step 1</think>The answer.", ("step 1", "The answer.")),
    ("k2 leading newline", K2, False, "\n<think>a</think>b", ("a", "b")),
    ("k2 no reasoning", K2, False, "Just an answer <think> later", ("", "Just an answer <think> later")),
    ("k2 prompt opened", K2, True, "step</think>answer", ("step", "answer")),
    ("k2 straight to tools", K2, True, "plan<|tool_calls_section_begin|>x", ("plan", "<|tool_calls_section_begin|>x")),
    ("k2 cut inside", K2, True, "still thinking", ("still thinking", "")),
    ("k3 close", K3, True, "r<|close|>think<|sep|><|open|>response<|sep|>a", ("r", "<|open|>response<|sep|>a")),
    ("k3 elided sep", K3, True, "r<|close|>think<|open|>response<|sep|>a", ("r", "<|open|>response<|sep|>a")),
    ("k3 omitted close", K3, True, "r<|open|>tools<|sep|>t", ("r", "<|open|>tools<|sep|>t")),
    ("k3 omitted close, response", K3, True, "r<|open|>response<|sep|>a", ("r", "<|open|>response<|sep|>a")),
    ("k3 thinking off", K3, False, "<|open|>response<|sep|>x", ("", "<|open|>response<|sep|>x")),
]


@pytest.mark.parametrize(("fmt", "opened", "text", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
@pytest.mark.parametrize("step", [None, 1, 3])
def test_split(fmt, opened, text, expected, step) -> None:
    assert split(fmt, opened, text, step) == expected


def test_a_close_cut_across_pieces_is_held_back_not_leaked() -> None:
    s = ReasoningSplitter(K3, True)
    assert s.feed("abc<|close|>thi") == ("abc", "")
    assert s.feed("nk") == ("", "")  # `<|close|>think` may still get its <|sep|>
    assert s.feed("<|sep|>answer") == ("", "answer")


def test_the_prompt_decides_where_the_reply_starts() -> None:
    assert prompt_end(K3, 'x<|open|>message role="assistant"<|sep|><|open|>think<|sep|>').in_reasoning
    off = prompt_end(K3, 'x<|open|>message role="assistant"<|sep|><|open|>response<|sep|>')
    assert not off.in_reasoning and off.in_response
    assert prompt_end(K2, "<|im_assistant|>assistant<|im_middle|><think>").in_reasoning
    assert not prompt_end(K2, "<|im_assistant|>assistant<|im_middle|><think></think>").in_reasoning  # K2.5, thinking off

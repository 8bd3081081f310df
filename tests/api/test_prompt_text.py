"""Prompts are tokenised off the event loop, and a prompt that certainly cannot fit is refused before it is tokenised."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import httpx
import pytest

from openk3.api.prompt_text import PromptEncoder, bytes_per_token_bound
from openk3.serve.tokenizer import ByteTokenizer
from tests.api.conftest import MAX_MODEL_LEN, start_server, stop_server


class BlockingTokenizer(ByteTokenizer):
    """The byte tokenizer, but `encode` of a text containing "block" signals `entered` and waits for `release`; every
    encoded text is recorded."""

    def __init__(self) -> None:
        super().__init__(256)  # the debug model's vocabulary: bytes only, no BOS
        self.entered = threading.Event()
        self.release = threading.Event()
        self.encoded: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded.append(text)
        if "block" in text:
            self.entered.set()
            self.release.wait()
        return super().encode(text, add_special_tokens)


@pytest.fixture(scope="module")
def blocking(torch_one_thread):
    tokenizer = BlockingTokenizer()
    live = start_server(tokenizer=tokenizer)
    yield live, tokenizer
    tokenizer.release.set()
    stop_server(live)


def test_tokenising_does_not_block_the_event_loop(blocking) -> None:
    live, tokenizer = blocking
    result: list[httpx.Response] = []
    body = {"model": "debug", "prompt": "block here", "max_tokens": 2}
    t = threading.Thread(target=lambda: result.append(httpx.post(live.base_url + "/v1/completions", json=body, timeout=60)))
    t.start()
    try:
        assert tokenizer.entered.wait(30)
        # the encode is stuck; were it on the event loop, nothing below could be answered
        assert httpx.get(live.base_url + "/health", timeout=30).status_code == 200
        chat = {"model": "debug", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert httpx.post(live.base_url + "/v1/chat/completions", json=chat, timeout=30).status_code == 200
    finally:
        tokenizer.release.set()
        t.join(60)
    assert result[0].status_code == 200 and result[0].json()["usage"]["prompt_tokens"] == len("block here")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_too_long_by_size_is_refused_before_tokenising(blocking, route: str) -> None:
    live, tokenizer = blocking
    text = "\u00e9" * MAX_MODEL_LEN  # 2 bytes each: twice the context in bytes, and the byte tokenizer spends one token per byte
    base = {"prompt": text} if route == "/v1/completions" else {"messages": [{"role": "user", "content": text}]}
    before = len(tokenizer.encoded)
    r = httpx.post(live.base_url + route, json={"model": "debug", **base, "max_tokens": 2}, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    size = 2 * MAX_MODEL_LEN + (0 if route == "/v1/completions" else len(b"<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"))
    assert f"is {size} bytes of text" in error["message"]
    assert [t for t in tokenizer.encoded[before:] if text in t] == []  # never tokenised


def test_size_bound() -> None:
    encoder = PromptEncoder(ByteTokenizer(), max_model_len=11)
    try:
        encoder.check_size("x" * 10, "prompt")  # 10 tokens + 1 completion token fit
        encoder.check_size("\u00e9" * 5, "prompt")
        with pytest.raises(Exception, match="at least 11 tokens"):
            encoder.check_size("x" * 11, "prompt")
        with pytest.raises(Exception, match="12 bytes"):
            encoder.check_size("\u00e9" * 6, "prompt")  # 6 characters, but 12 bytes
    finally:
        encoder.close()
    assert bytes_per_token_bound(ByteTokenizer()) == 1


def test_unknown_tokenizers_get_no_size_bound() -> None:
    class Words:
        vocab_size, eos_token_id, bos_token_id = 10, None, None

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [0] * len(text.split())

        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            return " ".join("w" for _ in token_ids)

        special_token_strings: frozenset[str] = frozenset()

        def encode_with_plain(self, text: str, plain: Sequence[tuple[int, int]]) -> list[int]:
            return self.encode(text)

    assert bytes_per_token_bound(Words()) is None  # a token may stand for any number of bytes: only the token count decides

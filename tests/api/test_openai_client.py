"""The official `openai` client, unchanged, against the server: completions and chat, streaming and not, n, stop, logprobs, seeds, usage."""

from __future__ import annotations

import pytest

from tests.api.conftest import MAX_MODEL_LEN

openai = pytest.importorskip("openai", reason="the openai client is the peer oracle for the wire format")

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def greedy(client, prompt: str = PROMPT, max_tokens: int = 12) -> str:
    r = client.completions.create(model="debug", prompt=prompt, max_tokens=max_tokens, temperature=0)
    return r.choices[0].text


def test_completion_fields_and_usage(client) -> None:
    r = client.completions.create(model="debug", prompt=PROMPT, max_tokens=7, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "debug"
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert r.usage.prompt_tokens == len(PROMPT.encode()) and r.usage.completion_tokens == 7 and r.usage.total_tokens == len(PROMPT) + 7
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_stream_concatenates_to_the_non_streamed_text(client) -> None:
    expected = greedy(client)
    chunks = list(client.completions.create(model="debug", prompt=PROMPT, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stream_matches_chat(client) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    r = client.chat.completions.create(model="debug", messages=messages, max_tokens=10, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.usage.completion_tokens <= 10
    chunks = list(
        client.chat.completions.create(model="debug", messages=messages, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_n_and_seed_reproducibility(client) -> None:
    def sample(seed: int):
        r = client.completions.create(model="debug", prompt=PROMPT, max_tokens=8, n=3, temperature=1.0, seed=seed)
        assert sorted(c.index for c in r.choices) == [0, 1, 2] and r.usage.completion_tokens == 24
        return [c.text for c in sorted(r.choices, key=lambda c: c.index)]

    first = sample(42)
    assert sample(42) == first
    assert sample(43) != first
    assert len(set(first)) > 1  # the n samples get distinct seeds


def test_chat_n_streams_every_choice(client) -> None:
    chunks = list(
        client.chat.completions.create(model="debug", messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=2, temperature=1.0, seed=1, stream=True)
    )
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence_cuts_the_text(client, stream: bool) -> None:
    full = greedy(client, max_tokens=24)
    start = next(i for i in range(4, len(full) - 2) if "\ufffd" not in full[i : i + 2])
    stop = full[start : start + 2]
    expected = full[: full.find(stop)]
    if stream:
        chunks = list(client.completions.create(model="debug", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True))
        text = "".join(c.choices[0].text for c in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        r = client.completions.create(model="debug", prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
        text, reason = r.choices[0].text, r.choices[0].finish_reason
    assert text == expected and reason == "stop"


def test_completion_logprobs(client) -> None:
    r = client.completions.create(model="debug", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(v >= max(top.values()) - 1e-5 for v, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True))


def test_chat_logprobs(client) -> None:
    r = client.chat.completions.create(model="debug", messages=[{"role": "user", "content": "x"}], max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_max_tokens_and_batch_prompts(client) -> None:
    r = client.completions.create(model="debug", prompt=["ab", "cde"], max_tokens=3, n=2, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3]  # greedy: n copies agree


def test_token_prompt_and_echo(client) -> None:
    ids = list(b"hello")
    r = client.completions.create(model="debug", prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert r.choices[0].text.startswith("hello")
    assert r.choices[0].text[5:] == greedy(client, "hello", 4)


def test_models_endpoint(client) -> None:
    (model,) = client.models.list().data
    assert model.id == "debug"


def test_tokenize_detokenize_version_health(http) -> None:
    tokens = http.post("/tokenize", json={"prompt": "héllo"}).json()
    assert tokens["tokens"] == list("héllo".encode()) and tokens["count"] == 6
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "héllo"}
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert bytes(chat["tokens"]).decode() == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert "version" in http.get("/version").json()
    assert http.get("/health").status_code == 200


def test_tokenizer_info_is_what_lm_eval_reads_to_tokenize_remotely(http) -> None:
    """lm-evaluation-harness's local-completions tokenizes through the server when GET /tokenizer_info names an eos_token
    and /tokenize answers {"prompt", "add_special_tokens"} without a model (its check_remote_tokenizer_support)."""
    info = http.get("/tokenizer_info").json()
    assert "eos_token" in info and info["model_max_length"] == MAX_MODEL_LEN  # the debug byte tokenizer's vocabulary has no specials
    assert info["tokenizer_class"] == "ByteTokenizer" and "<|im_start|>" in info["chat_template"]
    assert http.post("/tokenize", json={"prompt": "test", "add_special_tokens": False}).json()["tokens"] == list(b"test")


def test_vllm_extensions_through_extra_body_and_max_completion_tokens(client) -> None:
    r = client.completions.create(model="debug", prompt=PROMPT, max_tokens=10, temperature=1.0, seed=3, extra_body={"top_k": 1})
    assert r.choices[0].text == greedy(client, max_tokens=10)  # top_k=1 leaves only the argmax
    r = client.completions.create(model="debug", prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"min_tokens": 10, "ignore_eos": True})
    assert r.usage.completion_tokens == 10
    r = client.chat.completions.create(model="debug", messages=[{"role": "user", "content": "q"}], max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens <= 3 and r.choices[0].finish_reason in ("length", "stop")

"""Scoring a prompt over HTTP, as lm-eval's loglikelihood tasks and vLLM's clients ask: echo + logprobs (with max_tokens 1,
or 0 to generate nothing) and `prompt_logprobs`, compared with the served model's own cache-free forward to 1e-4 (fp32)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tests.api.test_bad_input import error_of

openai = pytest.importorskip("openai", reason="the openai client is the peer oracle for the wire format")

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model(live):
    return live.in_loop(live.frontend.call(lambda e: e.model))


def reference(model, ids: list[int]) -> list[float]:
    """logprob of ids[i] given ids[:i], i = 1.."""
    with torch.inference_mode():
        logprobs = model.forward_tokens(torch.tensor([ids])).float().log_softmax(-1)[0, :-1]
    return logprobs.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32, 127) for _ in range(n)]


def test_lm_eval_loglikelihood_request(http, model) -> None:
    """lm-eval local-completions: token prompts, echo, logprobs=1, max_tokens=1; it sums token_logprobs[ctxlen:-1] and
    calls a continuation greedy when each token's logprob is the top of its top_logprobs."""
    contexts, continuations = [ids(1, 30), ids(2, 12)], [ids(3, 5), ids(4, 3)]
    prompts = [c + k for c, k in zip(contexts, continuations, strict=True)]
    body = {"model": "debug", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    for choice in sorted(r.json()["choices"], key=lambda c: c["index"]):
        prompt, ctxlen = prompts[choice["index"]], len(contexts[choice["index"]])
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(prompt) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = reference(model, prompt)
        got = lp["token_logprobs"][1 : len(prompt)]
        assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < TOLERANCE
        assert abs(sum(lp["token_logprobs"][ctxlen:-1]) - sum(want[ctxlen - 1 :])) < TOLERANCE
        for token, value, top in zip(lp["tokens"][1:-1], got, lp["top_logprobs"][1:-1], strict=True):
            assert top[token] == value and max(top.values()) >= value  # the token itself is always among them
        assert choice["text"].startswith(bytes(prompt).decode())


def test_max_tokens_0_scores_without_generating(live, model) -> None:
    prompt = ids(5, 20)
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0) as client:
        r = client.completions.create(model="debug", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    (choice,) = r.choices
    assert choice.text == bytes(prompt).decode() and r.usage.completion_tokens == 0
    assert choice.logprobs.tokens == [chr(t) for t in prompt] and choice.logprobs.text_offset == list(range(len(prompt)))
    want = reference(model, prompt)
    assert max(abs(g - w) for g, w in zip(choice.logprobs.token_logprobs[1:], want, strict=True)) < TOLERANCE


def test_max_tokens_0_needs_echo(http) -> None:
    err = error_of(http.post("/v1/completions", json={"model": "debug", "prompt": "hi", "max_tokens": 0}), 400)
    assert err["param"] == "max_tokens"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_as_vllm_returns_them(http, model, path) -> None:
    body: dict = {"model": "debug", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2}
    body |= {"prompt": "Scores, please"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Scores, please"}]}
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    scores = out["choices"][0]["prompt_logprobs"] if path == "/v1/completions" else out["prompt_logprobs"]
    assert len(scores) == out["usage"]["prompt_tokens"] and scores[0] is None
    prompt = http.post("/tokenize", json={"prompt": "Scores, please"} if path == "/v1/completions" else {"messages": body["messages"]}).json()["tokens"]
    for token, want, entry in zip(prompt[1:], reference(model, prompt), scores[1:], strict=True):
        mine = entry[str(token)]
        assert abs(mine["logprob"] - want) < TOLERANCE and mine["decoded_token"] == chr(token) and mine["rank"] >= 1
        assert 1 <= len(entry) <= 3 and {e["rank"] for t, e in entry.items() if t != str(token)} <= {1, 2}


def test_prompt_logprobs_in_a_stream_is_a_400(http) -> None:
    body = {"model": "debug", "messages": [{"role": "user", "content": "x"}], "stream": True, "prompt_logprobs": 1}
    assert error_of(http.post("/v1/chat/completions", json=body), 400)["param"] == "prompt_logprobs"


def test_a_streamed_echo_carries_the_prompt_logprobs_first(http) -> None:
    body = {"model": "debug", "prompt": "Echo me", "max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    pieces = [c["choices"][0] for c in chunks]
    assert "".join(p["text"] for p in pieces) == whole["text"]
    streamed = [v for p in pieces for v in p["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"] and streamed[0] is None
    assert [o for p in pieces for o in p["logprobs"]["text_offset"]] == whole["logprobs"]["text_offset"]

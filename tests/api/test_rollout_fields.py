"""The fields an RL trainer reads from /v1/completions (docs/rollouts.md): token ids in, the same ids out
(return_token_ids), each generated token's sampling logprob, and each MoE layer's experts for every token run
(return_routed_experts) -- the ones the model's own forward chooses; both refused in a stream, naming the field."""

from __future__ import annotations

import pytest
import torch

from openk3.serve.routing import RoutingRecorder
from tests.api.test_bad_input import error_of

TOLERANCE = 1e-4


def own_forward(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's cache-free forward over `ids`: [T, L, k] experts it routes to, and [T, V] next-token logprobs."""
    recorder = RoutingRecorder(model)
    with recorder.step(), torch.inference_mode():
        logprobs = model.forward_tokens(torch.tensor([ids])).float().log_softmax(-1)[0]
    return recorder.rows(), logprobs


def test_token_ids_logprobs_and_routed_experts_line_up(live, http) -> None:
    prompt = list(range(40, 70))
    body = {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 0, "return_token_ids": True, "return_routed_experts": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 5
    ids = prompt + choice["token_ids"]
    experts, logprobs = live.in_loop(live.frontend.call(lambda e: own_forward(e.model, ids[:-1])))
    routed = torch.tensor(choice["routed_experts"]["experts"])
    assert routed.shape == experts.shape  # every token run: the prompt and the completion but its last token
    assert torch.equal(routed.sort(-1).values, experts.long().sort(-1).values)
    want = [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(choice["token_ids"])]
    got = choice["logprobs"]["token_logprobs"]
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) < TOLERANCE


def test_without_the_fields_nothing_extra_comes_back(http) -> None:
    r = http.post("/v1/completions", json={"prompt": [50, 51, 52], "max_tokens": 2})
    (choice,) = r.json()["choices"]
    assert choice["token_ids"] is None and choice["prompt_token_ids"] is None and choice["routed_experts"] is None


@pytest.mark.parametrize("name", ["return_token_ids", "return_routed_experts"])
def test_refused_in_a_stream(http, name) -> None:
    r = http.post("/v1/completions", json={"prompt": [50, 51], "max_tokens": 2, "stream": True, name: True})
    assert error_of(r, 400)["param"] == name

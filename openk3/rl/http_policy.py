"""A policy served over HTTP: replies from an openk3 server's `/v1/completions` with token-id prompts, so the ids go in and
come back exactly (`return_token_ids`), with each sampled token's logprob (`logprobs: 0`), the routed experts when asked
(`return_routed_experts`) and the weight version each choice was sampled with. A group's live contexts go in one request
(a list of prompts), as LLMPolicy batches them in one generate call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import torch

from openk3.rl.policy import Context, Reply
from openk3.serve.routing import ROUTING_DTYPE, RoutingTrace
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import Tokenizer


class PolicyHTTPError(RuntimeError):
    """The server refused or failed a request (its status and body)."""


def completion_body(contexts: Sequence[Context], params: SamplingParams, model: str, return_routing: bool) -> dict[str, Any]:
    """The request for one reply per context; only the sampling fields an episode sets travel (the rest are the defaults)."""
    if params.structured_outputs is not None or params.logit_bias or params.allowed_token_ids is not None:
        raise ValueError("HTTPPolicy: structured outputs and token rules do not travel as SamplingParams over HTTP; use LLMPolicy")
    body: dict[str, Any] = {
        "model": model,
        "prompt": [list(c.token_ids) for c in contexts],
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stop": list(params.stop),
        "include_stop_str_in_output": params.include_stop_str_in_output,
        "ignore_eos": params.ignore_eos,
        "logprobs": 0,
        "return_token_ids": True,
        "return_routed_experts": return_routing,
    }
    if params.top_k is not None:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    return body


def reply_of(choice: dict[str, Any]) -> Reply:
    """One choice of a completion response as a Reply; a choice whose ids and logprobs do not line up is an error."""
    ids = tuple(choice["token_ids"])
    logprobs = tuple((choice.get("logprobs") or {}).get("token_logprobs") or ())
    if len(logprobs) != len(ids) or any(lp is None for lp in logprobs):
        raise PolicyHTTPError(f"choice {choice['index']}: {len(logprobs)} logprobs for {len(ids)} tokens")
    routing = None
    if choice.get("routed_experts") is not None:
        r = choice["routed_experts"]
        routing = RoutingTrace(tuple(r["layers"]), torch.tensor(r["experts"], dtype=ROUTING_DTYPE))
    return Reply(ids, logprobs, routing, choice.get("weight_version"))


class HTTPPolicy:
    """Replies from a served engine at `base_url` (module docstring); `tokenizer` must be the server's (the prompt and the
    observations are encoded here, once)."""

    def __init__(
        self,
        base_url: str,
        tokenizer: Tokenizer,
        params: SamplingParams,
        model: str | None = None,
        return_routing: bool = False,
        api_key: str | None = None,
        timeout_s: float = 600.0,
    ) -> None:
        """`model`: the served model's name; None asks the server (the first of GET /v1/models)."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s, headers=headers)
        self.tokenizer = tokenizer
        self.params = params
        self.return_routing = return_routing
        self.model = model if model is not None else str(self._call("GET", "/v1/models")["data"][0]["id"])

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        r = self.http.request(method, path, **kwargs)
        if r.status_code != 200:
            raise PolicyHTTPError(f"{method} {path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    @property
    def weight_version(self) -> int:
        return int(self._call("GET", "/get_weight_version")["weight_version"])

    def reply(self, contexts: Sequence[Context], turn: int) -> list[Reply]:
        body = completion_body(contexts, self.params, self.model, self.return_routing)
        choices = sorted(self._call("POST", "/v1/completions", json=body)["choices"], key=lambda c: c["index"])
        if len(choices) != len(contexts):
            raise PolicyHTTPError(f"{len(choices)} choices for {len(contexts)} prompts")
        return [reply_of(c) for c in choices]

    def close(self) -> None:
        self.http.close()

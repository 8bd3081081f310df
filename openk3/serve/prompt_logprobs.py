"""Prompt logprobs (vLLM's `prompt_logprobs`, and echo + logprobs on completions): how likely the model finds each prompt
token after the ones before it, scored from the logits of the prefill forward itself, never a second pass.

The logits at prompt position p score prompt token p + 1, so a request that asks gets logits for its prefill rows too
(the runner adds them to `logits_indices`); position P - 1 is the row that samples the first output token, so the P - 1
scored tokens are 1..P-1 (token 0 has nothing before it: the API reports None for it, as vLLM does).
Chunked prefill: each step scores the rows it computes, and `PromptScores` appends them by position, so the chunks join
up whatever their cuts. Prefix-cache hits: a cached prefix has no logits, so a request that asks starts from token 0 (the
scheduler refuses it the hit); its prefill still snapshots states for later requests. Preemption recomputes from token 0:
a restart replaces what was scored from that position on. Once the first output token is out the scores have been reported
and a recompute scores nothing again.
Legend: R prompt rows scored this step, V vocabulary.
"""

from __future__ import annotations

import torch

from openk3.serve.request import Request, TokenLogprobs


def rows_to_score(req: Request, start: int, num_tokens: int) -> range:
    """The prompt positions of this step's chunk [start, start + num_tokens) whose logits score a prompt token."""
    if req.sampling_params.prompt_logprobs is None or req.num_output_tokens:
        return range(0)
    return range(start, min(start + num_tokens, req.num_prompt_tokens - 1))


ROWS_PER_BLOCK = 256  # rows turned to fp32 logprobs at once: a whole long chunk x a large vocabulary would not fit


def score(logits_RV: torch.Tensor, targets: list[int], top_k: list[int]) -> list[TokenLogprobs]:
    """Each row's target token's logprob, its rank (1 + tokens more likely) and the row's top_k alternatives, in fp32."""
    out: list[TokenLogprobs] = []
    for a in range(0, len(targets), ROWS_PER_BLOCK):
        b = a + ROWS_PER_BLOCK
        out += _score_block(logits_RV[a:b], targets[a:b], top_k[a:b])
    return out


def _score_block(logits_RV: torch.Tensor, targets: list[int], top_k: list[int]) -> list[TokenLogprobs]:
    logprobs_RV = logits_RV.float().log_softmax(-1)
    target_R = torch.tensor(targets, dtype=torch.int64, device=logprobs_RV.device)
    chosen_R = logprobs_RV.gather(1, target_R[:, None])[:, 0]
    ranks = ((logprobs_RV > chosen_R[:, None]).sum(-1) + 1).tolist()
    k_max = max(top_k, default=0)
    top = logprobs_RV.topk(k_max) if k_max else None
    top_ids = top.indices.tolist() if top is not None else [[] for _ in targets]
    top_values = top.values.tolist() if top is not None else [[] for _ in targets]
    out = []
    for r, (token, value, rank, k) in enumerate(zip(targets, chosen_R.tolist(), ranks, top_k, strict=True)):
        out.append(TokenLogprobs(token, value, tuple(zip(top_ids[r][:k], top_values[r][:k], strict=True)), rank=rank))
    return out


class PromptScores:
    """The scores of each request's prompt so far (token 1 onwards), until its first output token takes them along."""

    def __init__(self) -> None:
        self._scores: dict[str, list[TokenLogprobs]] = {}

    def add(self, request_id: str, start: int, scores: list[TokenLogprobs]) -> None:
        """Scores of prompt tokens start + 1 onwards (a restart after preemption replaces those from there)."""
        kept = self._scores.setdefault(request_id, [])
        del kept[start:]
        if len(kept) != start:
            raise AssertionError(f"{request_id}: prompt scores from position {start}, but only {len(kept)} positions before it are scored")
        kept.extend(scores)

    def take(self, request_id: str) -> tuple[TokenLogprobs, ...] | None:
        scores = self._scores.pop(request_id, None)
        return None if scores is None else tuple(scores)

    def drop(self, request_id: str) -> None:
        self._scores.pop(request_id, None)

"""Per-request rules on which tokens may come next, applied to the logits before the sampler's other steps (vLLM's
`logit_bias`, `allowed_token_ids` and `bad_words`, with OpenAI's meaning of logit_bias: added to the logits).

- logit_bias: token id -> a value in [-100, 100] added to that token's logit (-100 bans it in practice, 100 nearly forces it).
- allowed_token_ids: every other token is masked.
- bad_words: token sequences that must not be written: a one-token word is always masked; a longer one's last token is
  masked while the output ends with the rest of it (vLLM's rule; the API layer tokenises each word with and without a
  leading space, as vLLM does).
Logprobs stay those of the raw distribution (the sampler takes them before any rule).
Legend: M rows (requests sampling this step), V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from openk3.serve.sampling import SamplingParams


def has_token_rules(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.allowed_token_ids is not None or bool(params.bad_words_token_ids)


def banned_by_bad_words(bad_words: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The tokens that would complete a bad word given the output so far."""
    banned = []
    for word in bad_words:
        head = list(word[:-1])
        if not head or (len(output_token_ids) >= len(head) and list(output_token_ids[len(output_token_ids) - len(head) :]) == head):
            banned.append(word[-1])
    return banned


def apply_token_rules(logits_MV: torch.Tensor, params: Sequence[SamplingParams], outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """The logits with each row's rules applied (a new tensor; rows without rules unchanged)."""
    logits_MV = logits_MV.clone()
    vocab = logits_MV.shape[1]
    for i, (p, out) in enumerate(zip(params, outputs, strict=True)):
        if p.allowed_token_ids is not None:
            allowed = torch.tensor([t for t in p.allowed_token_ids if t < vocab], dtype=torch.int64, device=logits_MV.device)
            keep = torch.full((vocab,), float("-inf"), device=logits_MV.device)
            keep[allowed] = 0.0
            logits_MV[i] += keep
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64, device=logits_MV.device)
            logits_MV[i, ids] += torch.tensor([b for _, b in p.logit_bias], dtype=logits_MV.dtype, device=logits_MV.device)
        banned = [t for t in banned_by_bad_words(p.bad_words_token_ids, out) if t < vocab]
        if banned:
            logits_MV[i, banned] = float("-inf")
    return logits_MV

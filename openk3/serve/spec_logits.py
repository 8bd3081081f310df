"""The target's distribution at each verified position of a speculative run, as plain decoding would sample it there.

A verification scores the pending token and k drafts in one forward; position i stands for the step that would sample
after the pending token and drafts[:i]. What the sampler (serve/sampler.py) does to one row's logits is done here to
each position with the request as it would stand at that step, in the sampler's order: token rules over the output so
far (logit_bias, allowed_token_ids, bad_words), the grammar's mask in the state after drafts[:i]
(serve/structured/matchers.py `draft_masks`), and the penalties counting the output so far. The acceptance rule
(serve/speculative.py) then reads these logits, so greedy output is plain decoding's token for token.

Grammars also cut drafts (`cut_drafts`, when the engine proposes): a draft run stops before its first token the grammar
rejects, and a sampled row's draft distributions q are restricted to the grammar's mask and renormalised. The cut keeps
the rejection rule exact: a draft x_i drawn from q_i is either inside the mask, where it is distributed as the restricted
q'_i and the rule with p_i and q'_i (both masked) yields p_i, or outside it, where the run is cut and position i draws
from p_i itself; either way position i's token is distributed as p_i. After the verification `accept_run` feeds the
matcher the kept tokens only, so it ends where plain decoding of them leaves it.

Logprobs of the kept tokens are those of the raw distribution at their positions (the sampler's too).
Legend: K draft tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from openk3.serve.request import Request, TokenLogprobs
from openk3.serve.sampler import SamplingRow, apply_penalties, token_logprobs
from openk3.serve.structured.matchers import GrammarStates
from openk3.serve.token_rules import apply_token_rules, has_token_rules


def sampling_row(req: Request) -> SamplingRow:
    """The sampler's row of a request as it stands (its output ends with the pending token)."""
    return SamplingRow(req.sampling_params, req.generator, req.token_ids, req.num_prompt_tokens, req.stop_token_ids, req.request_id)


def _allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, V] booleans from an xgrammar bitmask of n rows."""
    import xgrammar as xgr

    zeros = torch.zeros(len(bitmask), vocab)
    xgr.apply_token_bitmask_inplace(zeros, bitmask, vocab_size=vocab)
    return zeros == 0


def cut_drafts(grammars: GrammarStates, req: Request, vocab: int) -> None:
    """Cut a request's drafts before the first its grammar rejects, and restrict a sampled row's draft distributions to
    the grammar's mask at each kept draft (module docstring)."""
    if req.sampling_params.structured_outputs is None or not req.draft_token_ids:
        return
    bitmask, ok = grammars.draft_masks(sampling_row(req), req.draft_token_ids, vocab)
    req.draft_token_ids = req.draft_token_ids[:ok]
    if req.draft_probs is None:
        return
    if not ok:
        req.draft_probs = None
        return
    q_KV = req.draft_probs[:ok] * _allowed(bitmask[:ok], vocab).to(req.draft_probs.device)
    req.draft_probs = q_KV / q_KV.sum(-1, keepdim=True)  # each kept draft is inside its mask: the sums are > 0


def verified_logits(logits_KV: torch.Tensor, req: Request, grammars: GrammarStates) -> torch.Tensor:
    """The logits of a request's k + 1 verified positions after its token rules, grammar masks and penalties, each
    position with the output as it stands there (a new tensor; `logits_KV` itself when none of them applies)."""
    p = req.sampling_params
    if not has_token_rules(p) and p.structured_outputs is None and not p.has_penalties:
        return logits_KV
    drafts = req.draft_token_ids
    if len(logits_KV) != len(drafts) + 1:
        raise ValueError(f"{req.request_id}: {len(logits_KV)} verified positions for {len(drafts)} drafts (expected one more)")
    logits_KV = logits_KV.float().clone()
    vocab = logits_KV.shape[1]
    outputs = [req.output_token_ids + drafts[:i] for i in range(len(drafts) + 1)]
    if has_token_rules(p):
        logits_KV = apply_token_rules(logits_KV, [p] * len(outputs), outputs)
    if p.structured_outputs is not None:
        import xgrammar as xgr

        bitmask, ok = grammars.draft_masks(sampling_row(req), drafts, vocab)
        if ok < len(drafts):
            raise AssertionError(f"{req.request_id}: draft {ok} is outside its grammar; drafts are cut when proposed")
        xgr.apply_token_bitmask_inplace(logits_KV, bitmask.to(logits_KV.device), vocab_size=vocab)
    if p.has_penalties:
        prompt = req.token_ids[: req.num_prompt_tokens]
        rows = [SamplingRow(p, None, prompt + out, req.num_prompt_tokens, req.stop_token_ids) for out in outputs]
        logits_KV = apply_penalties(logits_KV, rows)
    return logits_KV


def accept_run(grammars: GrammarStates, req: Request, run: Sequence[int], vocab: int) -> None:
    """After a verification: the request's grammar reads the tokens it kept (nothing for a request without one)."""
    if req.sampling_params.structured_outputs is not None:
        grammars.accept_run(sampling_row(req), run, vocab)


def run_logprobs(logits_KV: torch.Tensor, run: Sequence[int], num_top: int) -> list[TokenLogprobs]:
    """Logprobs of each kept token from the raw logits of its position, with the `num_top` most likely there."""
    raw = logits_KV[: len(run)].float().log_softmax(-1)
    return [token_logprobs(raw[i], token, num_top) for i, token in enumerate(run)]

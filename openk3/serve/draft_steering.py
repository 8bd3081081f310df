"""Draft steering: a request with a grammar drafts inside it, not only has its drafts cut where they leave it.

Proposers draw each draft from the draft's logits (serve/speculative.py `draw_draft`). For a request with a grammar the
verification cuts the run before the first draft the grammar rejects (serve/spec_logits.py `cut_drafts`), so a draft that
wanders outside the grammar -- its unmasked top token is a newline where JSON wants a quote -- wastes the whole run. Here
each draft is drawn from the draft's logits under the grammar's mask in the state after the request's output and the
drafts drawn before it, as plain decoding masks the target: the matcher is fed each draft as it is drawn and rolled back
when the proposal ends, so it is where it was before. Nothing about the output changes: drafts only decide speed, and
`cut_drafts` still runs after (a steered draft is always inside its mask, so it cuts nothing unless the grammar ended).
A sampled row's q is the masked distribution, which is what the rejection rule must see (cut_drafts renormalises it the
same way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from openk3.serve.request import Request
from openk3.serve.spec_logits import sampling_row
from openk3.serve.structured.matchers import GrammarStates


class _Walk:
    def __init__(self, matcher: Any, vocab: int) -> None:
        import xgrammar as xgr

        self.matcher = matcher
        self.vocab = vocab
        self.bitmask = xgr.allocate_token_bitmask(1, vocab)
        self.fed = 0
        self.off = False  # the grammar ended (or refused a draft): later drafts are left to cut_drafts

    def mask(self, logits_V: torch.Tensor) -> torch.Tensor:
        if self.off or self.matcher.is_terminated():
            return logits_V
        import xgrammar as xgr

        self.matcher.fill_next_token_bitmask(self.bitmask, 0)
        masked = logits_V.float().clone()[None]  # the draft shares the target's vocabulary: the grammar's width
        xgr.apply_token_bitmask_inplace(masked, self.bitmask.to(masked.device), vocab_size=self.vocab)
        if not torch.isfinite(masked).any():  # a draft vocabulary with none of the allowed tokens (an EAGLE-3 head's)
            self.off = True
            return logits_V
        return masked[0]

    def take(self, token: int) -> None:
        if self.off or self.matcher.is_terminated():
            return
        if self.matcher.accept_token(token):
            self.fed += 1
        else:
            self.off = True

    def close(self) -> None:
        if self.fed:
            self.matcher.rollback(self.fed)
        self.fed = 0


class DraftSteering:
    """The grammar walks of one proposal, by request id: `mask` before a draft is drawn, `take` after, `close` at the end
    (every matcher back where it was)."""

    def __init__(self, grammars: GrammarStates, reqs: Sequence[Request], vocab: int) -> None:
        self._walks = {r.request_id: _Walk(grammars.matcher(sampling_row(r), vocab), vocab) for r in reqs if r.sampling_params.structured_outputs is not None}

    def __bool__(self) -> bool:
        return bool(self._walks)

    def covers(self, req: Request) -> bool:
        """Whether `req` has a grammar to draft inside."""
        return req.request_id in self._walks

    def mask(self, req: Request, logits_V: torch.Tensor) -> torch.Tensor:
        walk = self._walks.get(req.request_id)
        return logits_V if walk is None else walk.mask(logits_V)

    def take(self, req: Request, token: int) -> None:
        walk = self._walks.get(req.request_id)
        if walk is not None:
            walk.take(token)

    def close(self) -> None:
        for walk in self._walks.values():
            walk.close()

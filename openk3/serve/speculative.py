"""Speculative decoding: which requests speculate and get drafts, the acceptance rule, and the metrics (the draft model is serve/draft.py).

A decoding request gets k draft tokens (serve/draft.py) before the step is planned; the scheduler gives it its pending token
plus the k drafts (or drops the drafts when the budget cannot take them all); the runner verifies the k + 1 positions in
the one target forward of the step and keeps the accepted run, cut at the first token a stop rule ends the request on.
Rollback on the hybrid cache: MLA pages of rejected positions are simply overwritten later (and the pages past the kept
tokens released by the scheduler); the KDA recurrent state and short-conv windows are updated in place, so a step whose
requests all decode or verify runs stepwise (serve/spec_states.py, model/stepwise.py): the decode forms one position after
another, keeping the state after each verified position in a verify slot, and a rejection copies the kept position's
state into the request's slot -- no second forward. A step that also prefills verifies in the chunked form: the runner
copies the request's slot before the forward and, when fewer than k + 1 tokens are kept, restores it and recomputes the
accepted prefix (pending token + accepted drafts) in a second forward of the step.

Acceptance: greedy rows keep drafts while they equal the target's argmax, then take the argmax (so the output is the
non-speculative greedy output); sampled rows use the standard rejection rule (Leviathan et al. 2023): keep draft x with
probability min(1, p(x) / q(x)), else draw from max(p - q, 0) normalised, and draw a bonus token from p when all k are
kept, which leaves the output distribution exactly p.
Legend: K draft tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from openk3.checks import check_int
from openk3.serve.draft_steering import DraftSteering
from openk3.serve.request import Request
from openk3.serve.sampler import apply_top_k_top_p_min_p
from openk3.serve.sampling import SamplingParams
from openk3.serve.spec_logits import cut_drafts
from openk3.serve.structured.matchers import GrammarStates


@dataclass(frozen=True)
class SpeculativeConfig:
    """k draft tokens per request and step; `disable_by_batch_size` (vLLM's key): no request gets drafts in a step that
    begins with at least this many running requests (a large batch decodes faster without them)."""

    num_speculative_tokens: int = 3
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        check_int("SpeculativeConfig", "num_speculative_tokens", self.num_speculative_tokens, low=1)
        if self.disable_by_batch_size is not None:
            check_int("SpeculativeConfig", "disable_by_batch_size", self.disable_by_batch_size, low=2)


@dataclass
class SpecDecodeStats:
    """vLLM's spec_decode counters: drafts proposed, drafts accepted, and accepted per draft position."""

    num_drafts: int = 0  # verification runs (one per speculating request and step)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position.extend([0] * (num_draft - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification: accepted drafts plus the one the target adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def can_speculate(req: Request) -> bool:
    """Every request but two kinds, which decode one token a step: one whose stop tokens are still masked by min_tokens,
    and one that records its routing (return_routing: a rolled-back run's experts would have to be recorded per kept
    position). Token rules, grammars and penalties are applied per verified position and logprobs taken there
    (serve/spec_logits.py)."""
    p = req.sampling_params
    return not p.return_routing and req.num_output_tokens >= p.min_tokens


class Proposer(Protocol):
    """A draft (serve/draft.py, serve/mtp_draft.py): k tokens per request and step."""

    k: int

    def release(self, live: set[str]) -> None: ...

    def propose(self, reqs: list[tuple[Request, int]], steer: DraftSteering | None = None) -> None: ...


def propose_drafts(proposer: Proposer, config: SpeculativeConfig, running: Sequence[Request], max_model_len: int, grammars: GrammarStates, vocab: int) -> bool:
    """Drafts for every running request in decode that can speculate, as many as its length limits leave room for, cut
    by its grammar (serve/spec_logits.py); False when no request speculates this step (disable_by_batch_size), whose
    running requests then hold no drafts (not even ones an earlier step proposed but could not schedule)."""
    proposer.release({r.request_id for r in running})  # a preempted request catches up again later
    if config.disable_by_batch_size is not None and len(running) >= config.disable_by_batch_size:
        for req in running:
            req.draft_token_ids, req.draft_probs = [], None
        return False
    wanted = []
    for req in running:
        if req.num_computed_tokens != req.num_tokens - 1 or not req.num_output_tokens or not can_speculate(req):
            continue
        p = req.sampling_params
        room = max_model_len - req.num_tokens - 1
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - req.num_output_tokens - 1)
        k = min(proposer.k, room)
        if k > 0:
            wanted.append((req, k))
    steer = DraftSteering(grammars, [r for r, _ in wanted], vocab)
    try:
        proposer.propose(wanted, steer if steer else None)
    finally:
        steer.close()
    for req, _ in wanted:
        cut_drafts(grammars, req, vocab)
    return True


def target_probs(logits_KV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from given its processed logits (serve/spec_logits.py): temperature, min_p,
    top_k, top_p."""
    k = len(logits_KV)
    vocab = logits_KV.shape[1]
    dev = logits_KV.device
    top_k = torch.full((k,), params.top_k or vocab, device=dev)
    top_p = torch.full((k,), params.top_p, dtype=torch.float32, device=dev)
    min_p = torch.full((k,), params.min_p, dtype=torch.float32, device=dev)
    return apply_top_k_top_p_min_p(logits_KV.float() / params.temperature, top_k, top_p, min_p).softmax(-1)


def verify(
    logits_KV: torch.Tensor,
    drafts: list[int],
    draft_probs_KV: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator,
) -> tuple[list[int], int]:
    """The tokens a verification keeps (accepted drafts, then the target's own token) and how many drafts were accepted.
    `logits_KV`: the target's logits at the K + 1 verified positions; `draft_probs_KV`: the draft's distributions of the K
    drafts (None for a greedy request)."""
    k = len(drafts)
    if params.greedy:
        best = logits_KV.argmax(-1).tolist()
        j = 0
        while j < k and drafts[j] == best[j]:
            j += 1
        return drafts[:j] + [best[j]], j
    assert draft_probs_KV is not None
    p = target_probs(logits_KV, params)
    q = draft_probs_KV.to(p.device)
    u = torch.rand(k, device=p.device, generator=generator).tolist()
    for i, x in enumerate(drafts):
        px, qx = float(p[i, x]), float(q[i, x])
        if qx > 0 and u[i] * qx < px:  # u < p / q without dividing
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p == q up to rounding: the draw from p itself
            residual = p[i]
        return drafts[:i] + [int(torch.multinomial(residual, 1, generator=generator))], i
    return drafts + [int(torch.multinomial(p[k], 1, generator=generator))], k


def draw_steered(logits_V: torch.Tensor, req: Request, steer: DraftSteering | None, generator: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """One draft token (and its q for a sampled row) from a draft's logits, inside the request's grammar when steered
    (serve/draft_steering.py)."""
    if steer is None:
        return draw_draft(logits_V, req.sampling_params, generator)
    token, q = draw_draft(steer.mask(req, logits_V), req.sampling_params, generator)
    steer.take(req, token)
    return token, q


def draw_draft(logits_V: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> tuple[int, torch.Tensor | None]:
    """One draft token from a draft's logits: the argmax for a greedy request, else a sample from the request's sampling
    distribution q, returned with it (the rejection rule needs q)."""
    if params.greedy:
        return int(logits_V.argmax()), None
    q = target_probs(logits_V[None], params)[0]
    return int(torch.multinomial(q, 1, generator=generator)), q

"""The KDA states a speculative verification keeps per position, so that a rejection rolls back by one slot copy.

A step whose requests all decode (one token each) or verify drafts (pending token + k drafts) runs as a stepwise batch
(model/stepwise.py): every row goes through the decode forms, and for each verifying request the state after its first
1..k tokens is cut into a verify slot (CacheManager's `verify_slots`, k per running request, held by no request). When
the target keeps j + 1 of the k + 1 tokens (j accepted drafts, then its own token, which is not run yet), the request's
slot takes the state after j + 1 tokens from its verify slot -- exactly what a plain decode of those tokens leaves -- and
needs no second forward; when it keeps all k + 1, its slot already holds that state. A step that also prefills (a new
request's prompt chunk, prompt scoring, images, prefix-cache cuts) runs the verification rows in the chunked form as part
of the one forward and falls back to the snapshot and recompute of runner.py.
"""

from __future__ import annotations

import dataclasses

from openk3.model.batch import ForwardBatch, StateCut
from openk3.serve.cache.manager import CacheManager
from openk3.serve.cache.transfer import copy_slot
from openk3.serve.request import Request
from openk3.serve.scheduler import SchedulerOutput


def stepwise_verification(
    out: SchedulerOutput, batch: ForwardBatch, verifying: list[Request], cache: CacheManager
) -> tuple[ForwardBatch, dict[str, list[int]]] | None:
    """The step as a stepwise batch with the verifying requests' per-position cuts, and request id -> the verify slots of
    its states after 1..k tokens; None when the step cannot run stepwise (module docstring)."""
    if not verifying or batch.state_cuts or batch.mm_embeds is not None or out.cuts:
        return None
    drafting = {r.request_id for r in verifying}
    for req, n in zip(out.requests, out.num_tokens, strict=True):
        if req.request_id not in drafting and (n != 1 or req.num_computed_tokens + 1 != req.num_tokens):
            return None  # a prefill row: the chunked forms run the step
    if sum(len(r.draft_token_ids) for r in verifying) > len(cache.verify_slots):
        return None
    free = iter(cache.verify_slots)
    cuts: list[StateCut] = []
    kept: dict[str, list[int]] = {}
    for i, req in enumerate(out.requests):
        if req.request_id in drafting:
            slots = [next(free) for _ in req.draft_token_ids]
            kept[req.request_id] = slots
            cuts.extend(StateCut(i, offset, slot) for offset, slot in enumerate(slots, start=1))
    return dataclasses.replace(batch, stepwise=True, state_cuts=tuple(cuts)), kept


def keep_verified_state(cache: CacheManager, req: Request, kept_slots: list[int], num_kept: int) -> None:
    """Leave req's slot with the state after the first `num_kept` of its verified tokens (its pending token and the
    accepted drafts); the verification ran all len(kept_slots) + 1 of them."""
    if num_kept <= len(kept_slots):
        copy_slot(cache.tensors, kept_slots[num_kept - 1], cache.slot(req.request_id))

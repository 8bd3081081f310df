"""DraftProposer: a separate small model sharing the target's tokenizer proposes k tokens per decoding request and step.

The draft model keeps its own hybrid cache (a CacheManager of its own: MLA pages and a KDA state slot per request). Each
proposal first catches the draft up with the request's tokens it has not seen (the whole prompt the first time, then the
tokens the last verification kept), copies the slot, drafts k tokens by k - 1 more one-token forwards, and puts the slot
back: the draft's state always covers exactly the request's real tokens, so a rejection needs nothing undone here (the
MLA pages of the draft positions are overwritten by the next catch-up). Drafts only decide speed: what is output is
decided by the target's verification (serve/speculative.py), so the draft's numerics never change the output.
Legend: K draft tokens, V vocabulary.
"""

from __future__ import annotations

import torch

from openk3.serve.cache.manager import CacheManager
from openk3.serve.draft_steering import DraftSteering
from openk3.serve.pack import PackedRow, pack, restore_slot, save_slot
from openk3.serve.request import Request
from openk3.serve.runner import CausalLM
from openk3.serve.speculative import draw_steered


class DraftProposer:
    def __init__(self, model: CausalLM, num_tokens: int, max_num_seqs: int, max_model_len: int, page_size: int, seed: int = 0) -> None:
        self.model = model
        self.k = num_tokens
        p = next(iter(model.parameters()))
        self.device = p.device
        pages = max_num_seqs * -(-(max_model_len + num_tokens) // page_size)
        self.cache = CacheManager(model.config, pages, page_size, max_num_seqs, dtype=p.dtype, device=p.device)
        self._computed: dict[str, int] = {}  # request id -> its tokens the draft's cache holds
        self.generator = torch.Generator(device=p.device).manual_seed(seed)

    def release(self, live: set[str]) -> None:
        """Free the draft cache of every request not in `live` (finished, aborted, preempted)."""
        for rid in [r for r in self._computed if r not in live]:
            self.cache.free(rid)
            del self._computed[rid]

    def _draw(self, logits_V: torch.Tensor, req: Request, steer: DraftSteering | None) -> tuple[int, torch.Tensor | None]:
        return draw_steered(logits_V, req, steer, self.generator)

    def propose(self, reqs: list[tuple[Request, int]], steer: DraftSteering | None = None) -> None:
        """Set `draft_token_ids` (and `draft_probs`) of each (request, k) pair: k draft tokens after its tokens. A request
        with no new token since its last proposal (its drafts were not verified) keeps the drafts it has."""
        reqs = [(r, k) for r, k in reqs if self._computed.get(r.request_id, 0) < r.num_tokens]  # the rest keep their drafts
        if not reqs:
            return
        rows = []
        for req, k in reqs:
            rid, n = req.request_id, req.num_tokens
            done = self._computed.get(rid, 0)
            if self.cache.allocate(rid, n + k) is None:
                raise RuntimeError(f"DraftProposer: no cache for {rid} ({n + k} tokens)")
            rows.append(PackedRow(self.cache.slot(rid), self.cache.page_ids(rid), done, req.token_ids[done:n]))
            self._computed[rid] = n
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        with torch.inference_mode():
            logits = self.model(pack(rows, self.device), self.cache.tensors)
            saved = [save_slot(self.cache, r.slot) for r in rows]
            live = list(range(len(reqs)))
            for step in range(max(k for _, k in reqs)):
                for i, row in zip(live, logits, strict=True):
                    token, q = self._draw(row, reqs[i][0], steer)
                    drafts[i].append(token)
                    if q is not None:
                        probs[i].append(q)
                live = [i for i in live if len(drafts[i]) < reqs[i][1]]
                if not live:
                    break
                step_rows = [PackedRow(rows[i].slot, rows[i].pages, reqs[i][0].num_tokens + step, [drafts[i][-1]]) for i in live]
                logits = self.model(pack(step_rows, self.device), self.cache.tensors)
            for r, s in zip(rows, saved, strict=True):
                restore_slot(self.cache, r.slot, s)
        for (req, _), d, q_list in zip(reqs, drafts, probs, strict=True):
            req.draft_token_ids = d
            req.draft_probs = torch.stack(q_list) if q_list else None

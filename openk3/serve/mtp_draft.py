"""MTPProposer: the checkpoint's multi-token-prediction layer (model/mtp.py) proposes k tokens per decoding request and step.

The layer reads the target's last hidden state at each position, so it follows the target rather than the request's
tokens: after every step the runner hands over the hidden rows of the positions each request keeps (ModelRunner.keep_hidden;
a verification's rows up to its last kept token), and `observe` runs the layer over them at once, in one forward for the
step (row p reads h_p and token p + 1, known by then), keeping each request's last output row. A proposal starts from that
row: its logits give the first draft, and each further draft runs the layer one position on, reading its own previous
output in place of the target's hidden state. The layer has a cache of its own (one layer: MLA pages, or a KDA slot that
is copied before drafting and put back, as serve/draft.py does), so drafting writes only positions the next catch-up
overwrites. A request whose rows do not start where the layer stopped (the target recomputed it after a preemption, or
began after a prefix-cache hit, where the target ran no rows) starts over at its first row: the layer then attends over
the positions it has seen, which changes drafts, never the output (the target's verification decides what is output).
Legend: T packed rows, D hidden, K draft tokens, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from openk3.model.mtp import MTPLayer
from openk3.serve.cache.manager import CacheManager
from openk3.serve.draft_steering import DraftSteering
from openk3.serve.pack import PackedRow, pack, restore_slot, save_slot
from openk3.serve.request import Request
from openk3.serve.speculative import draw_steered


@dataclass
class _Seen:
    """What the layer holds for one request: positions offset .. next - 1 (cache position = position - offset), and its
    output row at position next - 1 (what the first draft after token `next` is read from)."""

    offset: int
    next: int
    last_x: torch.Tensor


class MTPProposer:
    def __init__(self, layer: MTPLayer, num_tokens: int, max_num_seqs: int, max_model_len: int, page_size: int, seed: int = 0) -> None:
        self.layer = layer
        self.k = num_tokens
        p = layer.eh_proj.weight
        self.device = p.device
        pages = max_num_seqs * -(-(max_model_len + num_tokens) // page_size)
        self.cache = CacheManager(layer.config, pages, page_size, max_num_seqs, dtype=p.dtype, device=p.device)
        self._seen: dict[str, _Seen] = {}
        self.generator = torch.Generator(device=p.device).manual_seed(seed)

    def release(self, live: set[str]) -> None:
        """Free the layer's cache of every request not in `live` (finished, aborted, preempted)."""
        for rid in [r for r in self._seen if r not in live]:
            self._drop(rid)

    def check_integrity(self, live: set[str]) -> None:
        """The layer's cache holds exactly the requests it has seen, all of them among `live` (the running requests)."""
        self.cache.check_integrity()
        if self.cache.num_request_holders != len(self._seen) or any(rid not in live for rid in self._seen):
            raise AssertionError(f"MTPProposer holds {sorted(self._seen)} ({self.cache.num_request_holders} in its cache), running {sorted(live)}")

    def _drop(self, rid: str) -> None:
        self.cache.free(rid)
        del self._seen[rid]

    def _allocate(self, rid: str, positions: int) -> None:
        if self.cache.allocate(rid, positions) is None:
            raise RuntimeError(f"MTPProposer: no cache for {rid} ({positions} positions)")

    def observe(self, hidden: Mapping[str, tuple[int, torch.Tensor]], running: Iterable[Request]) -> None:
        """Run the layer over the hidden rows a step kept (ModelRunner.keep_hidden: request id -> (first position, rows))
        of the running requests, whose tokens after those positions are known; forget the requests no longer running."""
        live = {r.request_id: r for r in running}
        self.release(set(live))
        rows: list[PackedRow] = []
        parts: list[torch.Tensor] = []
        ids: list[str] = []
        for rid, (start, h_TD) in hidden.items():
            req = live.get(rid)
            if req is None or not len(h_TD):
                continue
            seen = self._seen.get(rid)
            if seen is not None and seen.next != start:
                self._drop(rid)  # the target ran it again from elsewhere (module docstring)
                seen = None
            offset = start if seen is None else seen.offset
            end = start + len(h_TD)
            self._allocate(rid, end - offset + self.k)
            rows.append(PackedRow(self.cache.slot(rid), self.cache.page_ids(rid), start - offset, req.token_ids[start + 1 : end + 1]))
            parts.append(h_TD)
            ids.append(rid)
            self._seen[rid] = _Seen(offset, end, torch.empty(0))
        if not rows:
            return
        with torch.inference_mode():
            batch = pack(rows, self.device)
            x_TD = self.layer(batch, self.cache.tensors, torch.cat(parts))
            assert batch.logits_indices is not None
            for rid, x_D in zip(ids, x_TD[batch.logits_indices], strict=True):
                self._seen[rid].last_x = x_D

    def _draw(self, logits_V: torch.Tensor, req: Request, steer: DraftSteering | None) -> tuple[int, torch.Tensor | None]:
        return draw_steered(logits_V, req, steer, self.generator)

    def propose(self, reqs: list[tuple[Request, int]], steer: DraftSteering | None = None) -> None:
        """Set `draft_token_ids` (and `draft_probs`) of each (request, k) pair whose positions the layer has caught up
        with (all but its last token); the others get none this step."""
        reqs = [(r, k) for r, k in reqs if (s := self._seen.get(r.request_id)) is not None and s.next == r.num_tokens - 1]
        if not reqs:
            return
        seen = [self._seen[r.request_id] for r, _ in reqs]
        slots = [self.cache.slot(r.request_id) for r, _ in reqs]
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        with torch.inference_mode():
            x_ND = torch.stack([s.last_x for s in seen])
            logits = self.layer.compute_logits(x_ND)
            saved = [save_slot(self.cache, slot) for slot in slots]
            live = list(range(len(reqs)))
            for step in range(max(k for _, k in reqs)):
                for i, row in zip(live, logits, strict=True):
                    token, q = self._draw(row, reqs[i][0], steer)
                    drafts[i].append(token)
                    if q is not None:
                        probs[i].append(q)
                x_ND = x_ND[[j for j, i in enumerate(live) if len(drafts[i]) < reqs[i][1]]]
                live = [i for i in live if len(drafts[i]) < reqs[i][1]]
                if not live:
                    break
                # position p = next + step reads the draft just made and the layer's own output at p - 1
                step_rows = [
                    PackedRow(slots[i], self.cache.page_ids(reqs[i][0].request_id), seen[i].next + step - seen[i].offset, [drafts[i][-1]]) for i in live
                ]
                batch = pack(step_rows, self.device)
                x_ND = self.layer(batch, self.cache.tensors, x_ND)
                logits = self.layer.compute_logits(x_ND)
            for slot, copy in zip(slots, saved, strict=True):
                restore_slot(self.cache, slot, copy)
        for (req, _), d, q_list in zip(reqs, drafts, probs, strict=True):
            req.draft_token_ids = d
            req.draft_probs = torch.stack(q_list) if q_list else None

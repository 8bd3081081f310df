"""Eagle3Proposer: an EAGLE-3 draft head (model/eagle3.py) proposes k tokens per decoding request and step.

It follows the target as serve/mtp_draft.py does: after every step the runner hands over, for the positions each request
keeps, the hidden states entering the head's three aux layers side by side (ModelRunner.keep_hidden with aux_layers;
K3Model.forward_with_aux says which tensor), and `observe` runs the head over them in one forward for the step (row p
reads fc(aux_p) and token p + 1, known by then), keeping the keys and values of those positions and each request's last
pre-norm output x. A proposal starts from that x: its logits give the first draft, and each further draft runs the head
one position on, reading its own previous x in place of fc(aux) and attending to the kept positions plus the chain's own
earlier drafts (held only for the proposal, so nothing needs undoing when drafts are rejected). A request whose rows do
not start where the head stopped (recomputed after a preemption, or begun after a prefix-cache hit, where the target ran
no rows) starts over at its first row; that changes drafts, never the output (the target's verification decides it).
The head's cache lives here, per request, in buffers that grow by doubling: one layer's rows are small beside the
target's cache. Two rows per position: the Llama head's keys and values, or the K3 MLA head's latent halves c_kv and k_pe
(model/eagle3_mla.py); `head.cache_rows()` gives their shapes.
Legend: T packed rows, H head hidden, G key/value heads, d head dim, V target vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from openk3.model.eagle3 import Past
from openk3.model.eagle3_mla import AnyEagle3Head
from openk3.serve.draft_steering import DraftSteering
from openk3.serve.request import Request
from openk3.serve.speculative import draw_draft, draw_steered


@dataclass
class _Seen:
    """What the head holds for one request: its two cached rows (keys/values [capacity, G, d], or the MLA head's c_kv /
    k_pe) of positions offset .. next - 1 (row = position - offset) and its output x at position next - 1 (what the first
    draft after token `next` is read from)."""

    offset: int
    next: int
    keys: torch.Tensor
    values: torch.Tensor
    last_x: torch.Tensor

    @property
    def held(self) -> int:
        return self.next - self.offset

    def append(self, k_TGd: torch.Tensor, v_TGd: torch.Tensor) -> None:
        need = self.held + len(k_TGd)
        if need > len(self.keys):
            cap = max(need, 2 * len(self.keys))
            self.keys = torch.cat([self.keys[: self.held], k_TGd.new_empty((cap - self.held, *k_TGd.shape[1:]))])
            self.values = torch.cat([self.values[: self.held], v_TGd.new_empty((cap - self.held, *v_TGd.shape[1:]))])
        self.keys[self.held : need] = k_TGd
        self.values[self.held : need] = v_TGd
        self.next += len(k_TGd)


class Eagle3Proposer:
    def __init__(self, head: AnyEagle3Head, num_tokens: int, seed: int = 0) -> None:
        self.head = head
        self.k = num_tokens
        self.device = head.fc.weight.device
        self._seen: dict[str, _Seen] = {}
        self.generator = torch.Generator(device=self.device).manual_seed(seed)

    def release(self, live: set[str]) -> None:
        """Forget every request not in `live` (finished, aborted, preempted)."""
        for rid in [r for r in self._seen if r not in live]:
            del self._seen[rid]

    def check_integrity(self, live: set[str]) -> None:
        """The head holds only running requests, each with room for the positions it has seen."""
        for rid, s in self._seen.items():
            if rid not in live or s.held < 0 or len(s.keys) < s.held or len(s.values) != len(s.keys):
                raise AssertionError(f"Eagle3Proposer holds {rid} (positions {s.offset}..{s.next - 1}, {len(s.keys)} rows), running {sorted(live)}")

    def observe(self, hidden: Mapping[str, tuple[int, torch.Tensor]], running: Iterable[Request]) -> None:
        """Run the head over the aux hidden rows a step kept (request id -> (first position, [n, 3 * D_target])) of the
        running requests, whose tokens after those positions are known; forget the requests no longer running."""
        live = {r.request_id: r for r in running}
        self.release(set(live))
        ids: list[str] = []
        tokens: list[int] = []
        parts: list[torch.Tensor] = []
        positions: list[int] = []
        for rid, (start, aux) in hidden.items():
            req = live.get(rid)
            if req is None or not len(aux):
                continue
            seen = self._seen.get(rid)
            if seen is None or seen.next != start:  # new, or the target ran it again from elsewhere (module docstring)
                key_row, value_row = self.head.cache_rows()
                dtype = self.head.fc.weight.dtype
                self._seen[rid] = _Seen(start, start, aux.new_empty((0, *key_row), dtype=dtype), aux.new_empty((0, *value_row), dtype=dtype), torch.empty(0))
            end = start + len(aux)
            ids.append(rid)
            tokens.extend(req.token_ids[start + 1 : end + 1])
            parts.append(aux)
            positions.extend(range(start, end))
        if not ids:
            return
        with torch.inference_mode():
            g_TH = self.head.fuse(torch.cat(parts))
            pasts, at = [], 0
            for rid, aux in zip(ids, parts, strict=True):
                s = self._seen[rid]
                pasts.append(Past(at, at + len(aux), s.keys[: s.held], s.values[: s.held]))
                at += len(aux)
            x, k, v = self.head(self._ids(tokens), g_TH, self._ids(positions), pasts)
            for rid, p in zip(ids, pasts, strict=True):
                s = self._seen[rid]
                s.append(k[p.start : p.end], v[p.start : p.end])
                s.last_x = x[p.end - 1]

    def _draw(self, logits_Vd: torch.Tensor, req: Request, steer: DraftSteering | None) -> tuple[int, torch.Tensor | None]:
        """A greedy request's draft is the draft vocabulary's argmax mapped to its target id (the same token as the
        argmax over the target's vocabulary, without spreading the logits over it); a sampled one draws from q over the
        target's vocabulary, which the rejection rule needs; one with a grammar draws over the target's vocabulary under
        the grammar's mask (serve/draft_steering.py)."""
        if steer is not None and steer.covers(req):
            return draw_steered(self.head.to_target(logits_Vd[None])[0], req, steer, self.generator)
        if req.sampling_params.greedy:
            best = int(logits_Vd.argmax())
            return best + int(self.head.d2t[best]), None
        return draw_draft(self.head.to_target(logits_Vd[None])[0], req.sampling_params, self.generator)

    def _ids(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def propose(self, reqs: list[tuple[Request, int]], steer: DraftSteering | None = None) -> None:
        """Set `draft_token_ids` (and `draft_probs`) of each (request, k) pair whose positions the head has caught up
        with (all but its last token); the others get none this step."""
        reqs = [(r, k) for r, k in reqs if (s := self._seen.get(r.request_id)) is not None and s.next == r.num_tokens - 1]
        if not reqs:
            return
        seen = [self._seen[r.request_id] for r, _ in reqs]
        drafts: list[list[int]] = [[] for _ in reqs]
        probs: list[list[torch.Tensor]] = [[] for _ in reqs]
        chain_k: list[list[torch.Tensor]] = [[] for _ in reqs]  # the chain's own keys/values, this proposal only
        chain_v: list[list[torch.Tensor]] = [[] for _ in reqs]
        with torch.inference_mode():
            x_NH = torch.stack([s.last_x for s in seen])
            logits = self.head.draft_logits(x_NH)
            live = list(range(len(reqs)))
            for step in range(max(k for _, k in reqs)):
                for i, row in zip(live, logits, strict=True):
                    token, q = self._draw(row, reqs[i][0], steer)
                    drafts[i].append(token)
                    if q is not None:
                        probs[i].append(q)
                x_NH = x_NH[[j for j, i in enumerate(live) if len(drafts[i]) < reqs[i][1]]]
                live = [i for i in live if len(drafts[i]) < reqs[i][1]]
                if not live:
                    break
                # position next + step reads the draft just made and the head's own x at the position before
                pasts = [
                    Past(j, j + 1, self._past(seen[i].keys[: seen[i].held], chain_k[i]), self._past(seen[i].values[: seen[i].held], chain_v[i]))
                    for j, i in enumerate(live)
                ]
                x_NH, k, v = self.head(self._ids([drafts[i][-1] for i in live]), x_NH, self._ids([seen[i].next + step for i in live]), pasts)
                for j, i in enumerate(live):
                    chain_k[i].append(k[j : j + 1])
                    chain_v[i].append(v[j : j + 1])
                logits = self.head.draft_logits(x_NH)
        for (req, _), d, q_list in zip(reqs, drafts, probs, strict=True):
            req.draft_token_ids = d
            req.draft_probs = torch.stack(q_list) if q_list else None

    @staticmethod
    def _past(kept: torch.Tensor, chain: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([kept, *chain]) if chain else kept

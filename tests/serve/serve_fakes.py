"""A fake model that obeys the serve <-> model contract and really uses the cache, so any slot or page misuse changes its output.

Per sequence it keeps a running hash of the tokens in its KDA state slot (with the token count beside it; also in the slot of
each of the batch's state cuts, as the hash after that many of the step's tokens), writes each token into
its MLA page at its position, and reads all earlier tokens back from the pages to form the logits. The next token is a function of
(hash, page checksum): a wrong slot, a wrong page, an unzeroed start or a skipped token gives different text. `reference_greedy`
computes the same tokens without any cache.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.config import ModelConfig, debug
from openk3.model.batch import CacheTensors, ForwardBatch

HASH_MOD = 1009
SUM_MOD = 1013


def step_hash(h: int, token: int) -> int:
    return (h * 31 + token + 1) % HASH_MOD


def checksum(tokens: list[int]) -> int:
    return sum((k + 1) * t for k, t in enumerate(tokens)) % SUM_MOD


def target_token(h: int, s: int, vocab: int) -> int:
    return (h * 7 + s * 3) % vocab


def logits_for(target: int, vocab: int) -> torch.Tensor:
    """A peaked but smooth distribution around `target` (sampling tests need more than one likely token)."""
    dist = (torch.arange(vocab) - target).abs().float()
    return -0.5 * dist


class FakeModel(nn.Module):
    def __init__(self, config: ModelConfig | None = None) -> None:
        super().__init__()
        self.config = config or debug()
        self.calls: list[ForwardBatch] = []

    def forward(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        self.calls.append(batch)
        vocab, ps = self.config.vocab_size, cache.page_size
        state, pages = cache.kda_state[0], cache.mla_latent[0]
        rows = []
        cu = batch.cu_seqlens.tolist()
        for i in range(batch.num_seqs):
            assert batch.state_slots is not None and batch.page_table is not None, "the engine addresses the cache in every step"
            slot = int(batch.state_slots[i])
            ctx = int(batch.context_lens[i])
            table = batch.page_table[i].tolist()
            if ctx == 0:
                h = 0
            else:
                h = int(state[slot, 0, 0, 0])
                assert int(state[slot, 0, 0, 1]) == ctx, f"slot {slot} holds {int(state[slot, 0, 0, 1])} tokens, batch says {ctx}"
            cuts = {c.offset: c.slot for c in batch.state_cuts if c.seq == i}
            for j, pos in enumerate(range(ctx, ctx + cu[i + 1] - cu[i])):
                if j in cuts:
                    state[cuts[j], 0, 0, 0], state[cuts[j], 0, 0, 1] = h, pos
                tok = int(batch.input_ids[cu[i] + j])
                assert int(batch.positions[cu[i] + j]) == pos
                pages[table[pos // ps], pos % ps, 0] = tok
                h = step_hash(h, tok)
                history = [int(pages[table[k // ps], k % ps, 0]) for k in range(pos + 1)]
                rows.append(logits_for(target_token(h, checksum(history), vocab), vocab))
            state[slot, 0, 0, 0] = h
            state[slot, 0, 0, 1] = cu[i + 1] - cu[i] + ctx
        logits = torch.stack(rows)
        return logits if batch.logits_indices is None else logits[batch.logits_indices]


def reference_greedy(prompt: list[int], num_tokens: int, vocab: int = 256) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(num_tokens):
        h = 0
        for t in tokens:
            h = step_hash(h, t)
        nxt = target_token(h, checksum(tokens), vocab)
        out.append(nxt)
        tokens.append(nxt)
    return out


class ScriptedModel(nn.Module):
    """Greedy output follows a fixed script by position: the token after position p is script[p + 1] (one-hot logits of 10).

    The prompt is meant to be a prefix of the script, so the expected output is simply the rest of the script.
    """

    def __init__(self, script: list[int], vocab_size: int = 260) -> None:
        super().__init__()
        self.config = debug().replace(vocab_size=vocab_size)
        self.script = script

    def forward(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        rows = batch.positions if batch.logits_indices is None else batch.positions[batch.logits_indices]
        logits = torch.zeros(len(rows), self.config.vocab_size)
        for i, pos in enumerate(rows.tolist()):
            logits[i, self.script[(pos + 1) % len(self.script)]] = 10.0
        return logits

"""Decode context parallelism's prefill chunks after a context (parallel/cp/sharded_mla.py `chunks_by_lse`): W ranks, each
holding its interleaved share of the pages, attend a step's chunks over their shares and merge by LSE with the chunk's own
causal part; the result equals one process attending the whole context read back from whole pages. The ranks run as
threads of this process whose all-gather meets at a barrier (the collective's contract, no process group)."""

from __future__ import annotations

import threading
from typing import cast

import pytest
import torch

from openk3.config import debug
from openk3.model.mla import GatedMLA
from openk3.parallel.cp.sharded_mla import LatentShards, attend_over, chunks_by_lse
from openk3.parallel.group import ParallelContext


class ThreadGather:
    """One rank's all-gather among `size` threads: every rank's tensor, stacked in rank order."""

    def __init__(self, rank: int, slots: list[torch.Tensor | None], barrier: threading.Barrier) -> None:
        self.rank, self.slots, self.barrier = rank, slots, barrier

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        self.slots[self.rank] = x
        self.barrier.wait()
        out = torch.stack([cast(torch.Tensor, s) for s in self.slots])
        self.barrier.wait()  # nobody overwrites a slot before every rank has read them all
        return out


@pytest.mark.parametrize("world", [2, 3])
def test_chunks_after_a_context_merge_to_one_process(world: int) -> None:
    torch.manual_seed(world)
    mla = GatedMLA(debug())
    mla.eval()
    r, h = mla.lora + mla.rope, mla.num_heads
    page_size, contexts, chunk_lens = 8 * world, [37, 1, 5], [9, 4, 2]  # a context shorter than the ranks: some hold none
    table = torch.tensor([[4, 0, 7], [1, 2, 3], [6, 5, 8]])
    pool = torch.randn(9, page_size, r)  # one process's pages: every sequence's context latents
    tokens = sum(chunk_lens)
    q_nope, q_pe = torch.randn(tokens, h, mla.nope), torch.randn(tokens, h, mla.rope)
    latent_TR = torch.randn(tokens, r)
    ends = torch.tensor(chunk_lens).cumsum(0).tolist()
    spans = list(zip([0, *ends[:-1]], ends, strict=True))
    with torch.no_grad():
        want = []
        for (lo, hi), pages, n in zip(spans, table, contexts, strict=True):
            whole = torch.cat([pool[pages].reshape(-1, r)[:n], latent_TR[lo:hi]])
            want.append(attend_over(mla, q_nope[lo:hi], q_pe[lo:hi], whole, n).float())
        slots: list[torch.Tensor | None] = [None] * world
        barrier = threading.Barrier(world, timeout=30)  # a rank that fails breaks the others' wait
        got: list[list[torch.Tensor]] = [[] for _ in range(world)]
        errors: list[BaseException] = []

        def rank(i: int) -> None:
            share = pool[:, i::world].contiguous()  # positions p = i mod W, row (p % PS) // W of each page
            ctx = cast(ParallelContext, ThreadGather(i, slots, barrier))
            try:
                got[i] = chunks_by_lse(mla, q_nope, q_pe, latent_TR, spans, list(zip(table, contexts, strict=True)), share, LatentShards(i, world), ctx)
            except BaseException as e:
                errors.append(e)
                barrier.abort()

        threads = [threading.Thread(target=rank, args=(i,)) for i in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    for i in range(world):
        assert len(got[i]) == len(spans), f"rank {i} did not finish"
        for g, w in zip(got[i], want, strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)

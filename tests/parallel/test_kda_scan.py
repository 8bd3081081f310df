"""The KDA scan across context-parallel ranks (parallel/cp/kda_scan.py), in one process: shards run from [0 | I] over
widened values, their state maps folded, give the outputs and end state of the whole sequence run at once -- by the
per-token definition (naive) and by the chunkwise kernels the engine runs -- and a wrong fold (a map dropped) does not;
the log-depth scan of the maps over gloo ranks gives each rank the one-by-one fold."""

from __future__ import annotations

import math

import pytest
import torch

from openk3.ops.kda.naive import kda_recurrent
from openk3.ops.registry import registry
from openk3.parallel.cp.exchange import shard_bounds
from openk3.parallel.cp.kda_scan import Affine, corrected_output, identity_start, start_of, widened

H, K, V = 2, 8, 6


def inputs(t: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(1, t, H, K, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(1, t, H, K, generator=gen), dim=-1)
    v = torch.randn(1, t, H, V, generator=gen)
    g = -torch.rand(1, t, H, K, generator=gen) * 0.3  # log decays in (-0.3, 0]: the state keeps a long memory
    beta = torch.rand(1, t, H, generator=gen)
    return q, k, v, g, beta


def scanned(prefill, q, k, v, g, beta, shards, first):  # type: ignore[no-untyped-def]
    """Every shard run alone (shard 0 from `first`, the others from [0 | I]), then folded as the ranks do."""
    outs, pairs, widened_outs = [], [], []
    for r, (lo, hi) in enumerate(shards):
        part = [x[:, lo:hi] for x in (q, k, v, g, beta)]
        cu = torch.tensor([0, hi - lo])
        if r == 0:
            o, end = prefill(*part[:4], part[4], None, first[None], cu)
            pairs.append(Affine(None, end[0]))
        else:
            part[2] = widened(part[2], K)
            o, end = prefill(*part, None, identity_start(H, K, V, q), cu)
            pairs.append(Affine.of_widened(end, V))
        widened_outs.append(o)
    packed = [Affine.unpacked(p.packed(), V) for p in pairs]  # through the all-gather's payload
    for r, o in enumerate(widened_outs):
        outs.append(o if r == 0 else corrected_output(o, start_of(r, packed, first), V))
    return torch.cat(outs, dim=1), packed[-1].apply(start_of(len(shards) - 1, packed, first))


@pytest.mark.parametrize("ranks", [2, 3, 5])
@pytest.mark.parametrize("after_context", [False, True])
def test_the_scan_equals_the_whole_sequence_by_the_definition(ranks: int, after_context: bool) -> None:
    q, k, v, g, beta = inputs(37, seed=ranks)
    first = torch.randn(H, K, V, generator=torch.Generator().manual_seed(9)) if after_context else torch.zeros(H, K, V)
    want_o, want_state = kda_recurrent(q, k, v, g, beta, None, first[None])
    got_o, got_state = scanned(kda_recurrent, q, k, v, g, beta, shard_bounds(37, ranks), first)
    assert torch.allclose(got_o, want_o, atol=1e-5) and torch.allclose(got_state, want_state[0], atol=1e-5)


@pytest.mark.parametrize("impl", ["fast", "mixed"])
def test_the_scan_through_the_engines_chunkwise_kernels(impl: str) -> None:
    prefill = registry().get("kda_prefill", impl)  # the CPU inference target's first backend: the C form where it builds
    q, k, v, g, beta = inputs(200, seed=3)
    first = torch.zeros(H, K, V)
    want_o, want_state = kda_recurrent(q, k, v, g, beta)
    got_o, got_state = scanned(prefill, q, k, v, g, beta, shard_bounds(200, 3), first)
    assert torch.allclose(got_o, want_o, atol=1e-4) and torch.allclose(got_state, want_state[0], atol=1e-4)


def test_a_dropped_map_is_not_the_same_sequence() -> None:
    """The check above can fail: folding without the middle shard's map gives another start state and other outputs."""
    q, k, v, g, beta = inputs(30, seed=1)
    shards = shard_bounds(30, 3)
    want_o, _ = kda_recurrent(q, k, v, g, beta)
    lo, hi = shards[2]
    o, _ = kda_recurrent(q[:, lo:hi], k[:, lo:hi], widened(v[:, lo:hi], K), g[:, lo:hi], beta[:, lo:hi], None, identity_start(H, K, V, q))
    end = shards[0][1]
    _, end0 = kda_recurrent(q[:, :end], k[:, :end], v[:, :end], g[:, :end], beta[:, :end])
    wrong = corrected_output(o, Affine(None, end0[0]).apply(torch.zeros(H, K, V)), V)  # rank 1's map left out
    assert (wrong - want_o[:, lo:hi]).abs().max() > 1e-2


def test_a_known_start_has_no_transition() -> None:
    end = torch.randn(H, K, V)
    pair = Affine.unpacked(Affine(None, end).packed(), V)
    assert torch.equal(pair.apply(torch.randn(H, K, V)), end)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4, 5])
def test_the_log_depth_scan_gives_each_rank_its_predecessors_fold(world: int) -> None:
    """kda_scan.predecessors on gloo ranks: each rank's start equals the one-by-one fold of the maps before it, and rank r
    receives 1 + (one per doubling round whose sender r - s >= 1) maps: at most 1 + ceil(log2(W - 1))."""
    from openk3.parallel.launch import run_ranks
    from tests.parallel.cp_cases import scan_rounds_case

    results = run_ranks(scan_rounds_case, world)
    for rank, e in enumerate(results):
        assert e["error"] <= 1e-5, f"rank {rank}: {e}"
        assert e["maps_received"] == (rank > 0) + sum(rank - s >= 1 for s in (1, 2, 4) if s < world - 1), f"rank {rank}"
    assert max(e["maps_received"] for e in results) == 1 + (world > 2) * math.ceil(math.log2(world - 1))

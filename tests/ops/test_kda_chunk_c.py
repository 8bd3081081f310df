"""The C form of the KDA chunked prefill (ops/kda/chunk_c.py, ops/cpu/kda_chunk.c) against the per-token definition."""

from __future__ import annotations

import pytest
import torch

from openk3.config import KDAGate
from openk3.ops.cpu.build import kernels_available
from openk3.ops.kda import kda_chunk, kda_recurrent
from openk3.ops.kda.chunk_c import kda_chunk_c, kda_mixed_c, slot_spans
from openk3.ops.kda.chunk_layout import ChunkLayout
from openk3.ops.registry import OpTarget, op
from tests.ops.test_kda import H, K, V, make_inputs, max_err, pack

pytestmark = pytest.mark.skipif(not kernels_available(), reason="no C compiler: the C kernels cannot be built here")


@pytest.mark.parametrize("gate", list(KDAGate))
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", [1, 15, 64, 65, 200])
@pytest.mark.parametrize("chunk_size", [8, 32, 64, 128])
def test_matches_recurrent(T: int, with_state: bool, gate: KDAGate, chunk_size: int) -> None:
    """Chunk sizes below, at and above the kernel's 16-row sub-block; T that ends mid-chunk, on a boundary, and in one token."""
    q, k, v, g, beta, state = make_inputs(2, T, gate, seed=T)
    S0 = state if with_state else None
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=S0)
    o, s = kda_chunk_c(q, k, v, g, beta, initial_state=S0, chunk_size=chunk_size)
    assert o.shape == (2, T, H, V) and s.shape == (2, H, K, V) and s.dtype == torch.float32
    assert max_err(o, o_ref) < 1e-4 and max_err(s, s_ref) < 1e-4


@pytest.mark.parametrize("per_token", [0.0, 3.0, 30.0, 300.0])
def test_exact_whatever_the_decay(per_token: float) -> None:
    """Decays from none to hundreds of nats per token: sub-blocks whose span allows the factored product (<= 80 nats) and
    ones summed term by term; exp(-G) over a chunk would overflow for the strong ones, the C form must not."""
    q, k, v, g, beta, S0 = make_inputs(1, 130, KDAGate.SOFTPLUS, seed=7)
    g = -per_token * torch.rand(g.shape, generator=torch.Generator().manual_seed(1)) ** 2
    g[:, 40:60] = 0.0
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=S0)
    o, s = kda_chunk_c(q, k, v, g, beta, initial_state=S0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert max_err(o, o_ref) < 1e-4 and max_err(s, s_ref) < 1e-4


def test_equals_the_torch_chunked_form_on_a_long_prompt() -> None:
    """The benchmark's shape class (head dim 128, several chunks) against kda_chunk, which the other tests hold to the definition."""
    q, k, v, g, beta, S0 = make_inputs(1, 700, KDAGate.LOWER_BOUND, seed=5, heads=2, dk=128, dv=128)
    o_ref, s_ref = kda_chunk(q, k, v, g, beta, initial_state=S0)
    o, s = kda_chunk_c(q, k, v, g, beta, initial_state=S0)
    assert max_err(o, o_ref) < 1e-4 and max_err(s, s_ref) < 1e-4


@pytest.mark.parametrize("lengths", [[37, 64, 100], [1, 130, 0, 3, 64, 1, 65]])
def test_packed_sequences_equal_separate_runs(lengths: list[int]) -> None:
    """Sequences ending at different chunk steps (ranks permute), 1-token ones and an empty one whose state passes through."""
    parts = [make_inputs(1, n, KDAGate.LOWER_BOUND, seed=i) for i, n in enumerate(lengths)]
    q, k, v, g, beta, S0 = pack(parts)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    for fn in (kda_chunk_c, kda_mixed_c):
        o, s = fn(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu)
        for n, p in enumerate(parts):
            o_n, s_n = kda_recurrent(*p[:5], initial_state=p[5])
            if lengths[n]:
                assert max_err(o[:, cu[n] : cu[n + 1]], o_n) < 1e-4
            assert max_err(s[n], s_n[0]) < 1e-4


def test_slot_spans_follow_the_layout() -> None:
    """Each slot's first token and count, against the token rows of ChunkLayout.to_chunks (what chunk.py reads)."""
    lengths = [5, 0, 20, 9]
    cu = torch.tensor([0, 5, 5, 25, 34])
    layout = ChunkLayout.build(1, 34, cu, 8)
    src, count = slot_spans(layout, 1, 34, cu)
    tokens = torch.arange(34, dtype=torch.float32).view(1, 34, 1, 1) + 1  # 1-based, so padding (0) is told apart
    rows = layout.to_chunks(tokens).view(layout.num_slots, 8)
    for slot in range(layout.num_slots):
        n = int(count[slot])
        assert rows[slot, :n].tolist() == [float(t + 1) for t in range(int(src[slot]), int(src[slot]) + n)]
        assert rows[slot, n:].eq(0).all()
    assert int(count.sum()) == sum(lengths)
    even = ChunkLayout.build(2, 20, None, 8)
    src, count = slot_spans(even, 2, 20, None)
    assert src.tolist() == [0, 20, 8, 28, 16, 36] and count.tolist() == [8, 8, 8, 8, 4, 4]


def test_registry_offers_it_on_the_c_backend_only() -> None:
    assert op("kda_prefill", "fast") is kda_chunk_c and op("kda_prefill", "auto") is kda_mixed_c
    assert op("kda_prefill", "fast", OpTarget(c_kernels=False)) is kda_chunk
    q, k, v, g, beta, _ = make_inputs(1, 10, KDAGate.LOWER_BOUND)
    with pytest.raises(ValueError, match="chunk_size=512"):
        kda_chunk_c(q, k, v, g, beta, chunk_size=512)
    with pytest.raises(RuntimeError, match="chosen for CPU fp32 inference"):
        kda_chunk_c(q.requires_grad_(), k, v, g, beta)

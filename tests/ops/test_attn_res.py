"""AttnRes: two-phase == one-shot (the ops and the residual streams), the closed-form special cases, and a loop-by-loop
transcription of the formula."""

from __future__ import annotations

import math

import pytest
import torch

from openk3.ops.attn_res import BlockPartial, DepthStream, MixQuery, OneShotStream, TwoPhaseStream, attn_res, attn_res_merge, attn_res_phase1, attn_res_sized
from openk3.ops.attn_res import sized as attn_res_sized_module

EPS = 1e-5


def _inputs(nb: int, q: int, n: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Blocks at different scales, as residual streams grow with depth; the query large enough that the softmax is far from uniform.
    scales = torch.rand(nb + 1, 1, 1, generator=g) * 4 + 0.25
    sources = torch.randn(nb + 1, n, d, generator=g) * scales
    queries = torch.randn(q, d, generator=g) * 0.5
    norm_weights = 1.0 + 0.3 * torch.randn(q, d, generator=g)
    return sources[:nb], sources[nb], queries, norm_weights


def _looped(sources: torch.Tensor, query: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula written with explicit loops over sources s and tokens n, in float64."""
    s_count, n_tok, d = sources.shape
    v = sources.double()
    w = (norm_weight.double() * query.double()).tolist()
    out = torch.zeros(n_tok, d, dtype=torch.float64)
    for n in range(n_tok):
        logits = []
        for s in range(s_count):
            row = v[s, n].tolist()
            rms = math.sqrt(sum(x * x for x in row) / d + eps)
            logits.append(sum(x / rms * wi for x, wi in zip(row, w, strict=True)))
        m = max(logits)
        weights = [math.exp(lg - m) for lg in logits]
        total = sum(weights)
        for s in range(s_count):
            out[n] += weights[s] / total * v[s, n]
    return out


@pytest.mark.parametrize("nb,q,n,d", [(1, 1, 1, 8), (1, 3, 5, 16), (3, 4, 7, 32), (8, 24, 3, 64), (2, 2, 17, 48)])
def test_two_phase_matches_one_shot_fp32(nb: int, q: int, n: int, d: int) -> None:
    blocks, prefix, queries, norm_weights = _inputs(nb, q, n, d, seed=nb * 100 + q)
    partial = attn_res_phase1(blocks, queries, norm_weights, EPS)
    assert partial.out_QND.shape == (q, n, d) and partial.lse_QN.shape == (q, n)
    assert partial.out_QND.dtype == torch.float32 and partial.lse_QN.dtype == torch.float32
    sources = torch.cat([blocks, prefix.unsqueeze(0)])
    for qi in range(q):
        got = attn_res_merge(partial, qi, prefix, queries[qi], norm_weights[qi], EPS)
        want = attn_res(sources, queries[qi], norm_weights[qi], EPS)
        # Sources reach |v| ~ 15, so a few fp32 ulps of the largest value is ~5e-6.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_phase1_alone_is_the_mix_over_blocks() -> None:
    blocks, _, queries, norm_weights = _inputs(4, 3, 6, 16, seed=7)
    partial = attn_res_phase1(blocks, queries, norm_weights, EPS)
    for qi in range(3):
        torch.testing.assert_close(partial.out_QND[qi], attn_res(blocks, queries[qi], norm_weights[qi], EPS), rtol=1e-6, atol=2e-6)


def test_two_phase_bf16_sources() -> None:
    blocks, prefix, queries, norm_weights = _inputs(5, 4, 9, 64, seed=3)
    blocks, prefix = blocks.bfloat16(), prefix.bfloat16()
    partial = attn_res_phase1(blocks, queries, norm_weights, EPS)
    sources = torch.cat([blocks, prefix.unsqueeze(0)])
    for qi in range(4):
        got = attn_res_merge(partial, qi, prefix, queries[qi], norm_weights[qi], EPS)
        want = attn_res(sources, queries[qi], norm_weights[qi], EPS)
        assert got.dtype == torch.bfloat16 and want.dtype == torch.bfloat16
        # Both compute in fp32 from the same bf16 inputs; only the final rounding to bf16 may differ (one ulp).
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got.float(), _looped(sources.float(), queries[qi], norm_weights[qi], EPS).float(), rtol=1e-2, atol=2e-2)


def test_zero_queries_give_uniform_mean() -> None:
    blocks, prefix, _, norm_weights = _inputs(3, 2, 5, 16, seed=11)
    zeros = torch.zeros(2, 16)
    sources = torch.cat([blocks, prefix.unsqueeze(0)])
    mean = sources.mean(0)
    torch.testing.assert_close(attn_res(sources, zeros[0], norm_weights[0], EPS), mean, rtol=1e-6, atol=1e-6)
    partial = attn_res_phase1(blocks, zeros, norm_weights, EPS)
    torch.testing.assert_close(attn_res_merge(partial, 1, prefix, zeros[1], norm_weights[1], EPS), mean, rtol=1e-6, atol=1e-6)


def test_single_source_is_returned_unchanged() -> None:
    blocks, _, queries, norm_weights = _inputs(1, 1, 4, 32, seed=5)
    for dtype in (torch.float32, torch.bfloat16):
        src = blocks.to(dtype)
        out = attn_res(src, queries[0], norm_weights[0], EPS)
        assert out.dtype == dtype
        assert torch.equal(out, src[0])


@pytest.mark.parametrize("nb,n,d", [(1, 3, 8), (4, 5, 12)])
def test_matches_looped_transcription(nb: int, n: int, d: int) -> None:
    blocks, prefix, queries, norm_weights = _inputs(nb, 1, n, d, seed=nb + n)
    sources = torch.cat([blocks, prefix.unsqueeze(0)])
    want = _looped(sources, queries[0], norm_weights[0], EPS)
    torch.testing.assert_close(attn_res(sources, queries[0], norm_weights[0], EPS).double(), want, rtol=1e-5, atol=1e-5)
    partial = attn_res_phase1(blocks, queries, norm_weights, EPS)
    torch.testing.assert_close(attn_res_merge(partial, 0, prefix, queries[0], norm_weights[0], EPS).double(), want, rtol=1e-5, atol=1e-5)


def test_gamma_and_query_enter_as_their_product() -> None:
    # The logits see gamma only through gamma * w, and gamma must actually be applied (doubling it changes the mix).
    blocks, prefix, queries, norm_weights = _inputs(2, 1, 4, 16, seed=9)
    sources = torch.cat([blocks, prefix.unsqueeze(0)])
    a = attn_res(sources, queries[0] * 2, norm_weights[0], EPS)
    b = attn_res(sources, queries[0], norm_weights[0] * 2, EPS)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, attn_res(sources, queries[0], norm_weights[0], EPS), atol=1e-3)


def test_bad_shapes_raise() -> None:
    blocks, prefix, queries, norm_weights = _inputs(2, 2, 3, 8, seed=1)
    with pytest.raises(ValueError, match="query"):
        attn_res(blocks, queries[0, :4], norm_weights[0], EPS)
    with pytest.raises(ValueError, match="nb >= 1"):
        attn_res_phase1(blocks[:0], queries, norm_weights, EPS)
    with pytest.raises(ValueError, match="norm_weights"):
        attn_res_phase1(blocks, queries, norm_weights[:1], EPS)
    partial = attn_res_phase1(blocks, queries, norm_weights, EPS)
    assert isinstance(partial, BlockPartial)
    with pytest.raises(ValueError, match="q=2"):
        attn_res_merge(partial, 2, prefix, queries[0], norm_weights[0], EPS)
    with pytest.raises(ValueError, match="prefix shape"):
        attn_res_merge(partial, 0, prefix[:2], queries[0], norm_weights[0], EPS)


def _run_stream(stream: DepthStream, layers: int, block_size: int, g: torch.Generator) -> list[torch.Tensor]:
    """A decoder's loop over `stream` (ops/attn_res/stream.py) with random sublayers: every read, in order."""
    n, d = 5, 16
    mixers = [MixQuery(key, torch.randn(d, generator=g), 1.0 + 0.3 * torch.randn(d, generator=g), EPS) for key in range(2 * layers + 1)]
    outs = [torch.randn(n, d, generator=g) for _ in range(2 * layers)]
    reads = []
    for i in range(layers):
        if i % block_size == 0:
            end = min(i + block_size, layers)
            readers = [mixers[k] for k in range(2 * i, 2 * end) if k > 0] + (mixers[-1:] if end == layers else [])
            stream.start_block(readers)
        for k in (2 * i, 2 * i + 1):
            reads.append(stream.read(mixers[k]))
            stream.add(outs[k] * reads[-1].tanh())  # the sublayer's output depends on its input, as in the model
    reads.append(stream.read(mixers[-1]))
    return reads


@pytest.mark.parametrize("layers,block_size", [(1, 1), (4, 1), (5, 2), (6, 3), (4, 9)])
def test_two_phase_stream_equals_one_shot_stream(layers: int, block_size: int) -> None:
    embed = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    want = _run_stream(OneShotStream(embed), layers, block_size, torch.Generator().manual_seed(1))
    got = _run_stream(TwoPhaseStream(embed), layers, block_size, torch.Generator().manual_seed(1))
    assert torch.equal(got[0], embed) and torch.equal(want[0], embed)  # the first layer reads the embedding unmixed
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_sized_stream_switches_at_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attn_res_sized_module, "TWO_PHASE_MIN_TOKENS", 5)
    assert isinstance(attn_res_sized(torch.zeros(4, 8)), OneShotStream)
    assert isinstance(attn_res_sized(torch.zeros(5, 8)), TwoPhaseStream)

"""AttnRes mixing in C (ops/attn_res/mix_c.py, ops/cpu/attn_res.c): the one-shot mix equals the definition
(ops/attn_res/naive.py, in fp64) to fp32 rounding, as the torch fp32 form does, for 1..9 sources, strided rows and large logits; the stream reads the same
inputs as OneShotStream through a block sequence; "auto" takes it on the "c" backend below TWO_PHASE_MIN_TOKENS tokens."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.attn_res import OneShotStream, TwoPhaseStream, attn_res
from openk3.ops.attn_res.mix_c import MAX_SOURCES, OneShotStreamC, attn_res_c
from openk3.ops.attn_res.stream import MixQuery
from openk3.ops.cpu.build import kernels_available
from openk3.ops.registry import CPU_INFERENCE, OpTarget, op
from openk3.ops.thresholds import TWO_PHASE_MIN_TOKENS

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C kernels do not build here")


def sources(s: int, n: int, d: int, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, d, generator=g) * scale * (1 + i) for i in range(s)]


@pytest.mark.parametrize("s", [1, 2, 3, 9])
@pytest.mark.parametrize("n,d", [(1, 256), (16, 256), (5, 100)])
def test_equals_the_definition(s: int, n: int, d: int) -> None:
    src = sources(s, n, d, seed=s * n + d)
    g = torch.Generator().manual_seed(7)
    query, gamma = torch.randn(d, generator=g), torch.rand(d, generator=g) + 0.5
    got = attn_res_c(src, query, gamma, 1e-6)
    # logits of ~20-50 make the softmax sharp: both fp32 forms are held to the fp64 definition by the values' size
    exact = attn_res(torch.stack(src).double(), query.double(), gamma.double(), 1e-6)
    bound = 2e-6 * float(max(x.abs().max() for x in src))
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=bound)
    torch.testing.assert_close(attn_res(torch.stack(src), query, gamma, 1e-6).double(), exact, rtol=0, atol=bound)


def test_large_logits_and_strided_rows() -> None:
    wide = torch.randn(8, 512, generator=torch.Generator().manual_seed(1))
    src = [wide[:, :256], wide[:, 256:], torch.randn(8, 256, generator=torch.Generator().manual_seed(2)).t().contiguous().t()]
    query = torch.full((256,), 3.0)  # logits of ~50: the softmax must subtract its maximum
    gamma = torch.ones(256)
    want = attn_res(torch.stack([x.contiguous() for x in src]), query, gamma, 1e-6)
    torch.testing.assert_close(attn_res_c(src, query, gamma, 1e-6), want, rtol=2e-5, atol=2e-6)


def test_refuses_what_it_does_not_take() -> None:
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="sources"):
        attn_res_c([x] * (MAX_SOURCES + 1), torch.zeros(8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="one \\[N, D\\] shape"):
        attn_res_c([x, torch.zeros(3, 8)], torch.zeros(8), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="query shape"):
        attn_res_c([x, x], torch.zeros(4), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="CPU fp32 inference"):
        attn_res_c([x.double(), x.double()], torch.zeros(8), torch.ones(8), 1e-6)


def test_stream_reads_what_the_one_shot_stream_reads() -> None:
    g = torch.Generator().manual_seed(3)
    embed = torch.randn(6, 64, generator=g)
    mixers = [MixQuery(i, torch.randn(64, generator=g), torch.rand(64, generator=g) + 0.5, 1e-6) for i in range(6)]
    outs = [torch.randn(6, 64, generator=g) for _ in range(6)]
    ref, fast = OneShotStream(embed), OneShotStreamC(embed)
    for i, (mixer, out) in enumerate(zip(mixers, outs, strict=True)):
        if i % 3 == 0:
            ref.start_block(mixers)
            fast.start_block(mixers)
        torch.testing.assert_close(fast.read(mixer), ref.read(mixer), rtol=2e-5, atol=2e-6)
        ref.add(out)
        fast.add(out)


def test_auto_takes_it_for_decode_sized_steps() -> None:
    stream = op("attn_res", "auto", CPU_INFERENCE)
    assert isinstance(stream(torch.zeros(16, 8)), OneShotStreamC)
    assert isinstance(stream(torch.zeros(TWO_PHASE_MIN_TOKENS, 8)), TwoPhaseStream)
    torch_only = op("attn_res", "auto", OpTarget(c_kernels=False))
    assert type(torch_only(torch.zeros(16, 8))) is OneShotStream


def test_stream_reads_equal_attn_res_c_bit_for_bit() -> None:
    """The stream's direct kernel calls (kept addresses) read what attn_res_c reads from the same sources, and a stream
    whose partial sum is not a plain row block (a column stride of 2 here) takes attn_res_c itself."""
    g = torch.Generator().manual_seed(6)
    embed = torch.randn(4, 32, generator=g)
    mixers = [MixQuery(i, torch.randn(32, generator=g), torch.rand(32, generator=g) + 0.5, 1e-6) for i in range(7)]
    for strided in (False, True):
        stream = OneShotStreamC(embed)
        blocks: list[torch.Tensor] = []
        partial: torch.Tensor | None = embed
        for i, mixer in enumerate(mixers):
            if i % 2 == 0:
                assert partial is not None
                stream.start_block(mixers)
                blocks, partial = [*blocks, partial], None
            sources = blocks if partial is None else [*blocks, partial]
            got = stream.read(mixer)
            want = sources[0] if len(sources) == 1 else attn_res_c(sources, mixer.query_D, mixer.norm_weight_D, mixer.eps)
            assert torch.equal(got, want)
            out = torch.randn(4, 64, generator=g)[:, :: 2 if strided and i == 2 else 1][:, :32]
            stream.add(out)
            partial = out if partial is None else partial + out
        assert stream._plain is not strided

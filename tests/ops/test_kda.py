"""KDA ops: chunked prefill and decode against the per-token definition, the gate against its formula, transformers as a peer oracle."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from openk3.config import KDAGate
from openk3.ops.kda import kda_chunk, kda_decode, kda_gate, kda_recurrent
from openk3.ops.kda.chunk import _factor_block, _intra_chunk
from openk3.ops.kda.chunk_autograd import kda_chunk_autograd
from openk3.ops.kda.decode_inplace import kda_decode_
from openk3.ops.kda.mixed import kda_mixed
from openk3.ops.norm import l2_norm
from openk3.ops.registry import OpTarget, op

H, K, V = 2, 32, 16

KDAInputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # q, k, v, g, beta, state


def make_inputs(B: int, T: int, gate: KDAGate, seed: int = 0, heads: int = H, dk: int = K, dv: int = V) -> KDAInputs:
    """Random KDA inputs with the layer's own gate; the softplus gate gets A in [1, 16] so decays reach tens of nats per token."""
    gen = torch.Generator().manual_seed(seed)
    q = l2_norm(torch.randn(B, T, heads, dk, generator=gen))
    k = l2_norm(torch.randn(B, T, heads, dk, generator=gen))
    v = torch.randn(B, T, heads, dv, generator=gen)
    f = 3 * torch.randn(B, T, heads, dk, generator=gen)
    dt_bias = torch.randn(heads * dk, generator=gen)
    if gate == KDAGate.SOFTPLUS:
        g = kda_gate(f, torch.empty(heads).uniform_(1, 16, generator=gen).log(), dt_bias, gate)
    else:
        g = kda_gate(f, torch.zeros(heads), dt_bias, gate, lower_bound=-5.0)
    beta = torch.sigmoid(torch.randn(B, T, heads, generator=gen))
    state = torch.randn(B, heads, dk, dv, generator=gen)
    return q, k, v, g, beta, state


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def pack(parts: list[KDAInputs]) -> KDAInputs:
    """Sequences packed along T into one batch row (B = 1), their states stacked."""
    q, k, v, g, beta = (torch.cat([p[i] for p in parts], dim=1) for i in range(5))
    return q, k, v, g, beta, torch.cat([p[5] for p in parts], dim=0)


@pytest.mark.parametrize("gate", list(KDAGate))
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_chunk_matches_recurrent(T: int, with_state: bool, gate: KDAGate) -> None:
    q, k, v, g, beta, state = make_inputs(2, T, gate, seed=T)
    S0 = state if with_state else None
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=S0)
    o, s = kda_chunk(q, k, v, g, beta, initial_state=S0)
    assert o.shape == (2, T, H, V) and s.shape == (2, H, K, V) and s.dtype == torch.float32
    assert max_err(o, o_ref) < 1e-4
    assert max_err(s, s_ref) < 1e-4


def test_chunk_exact_under_extreme_decay() -> None:
    """Per-token decays from 0 to -300 nats: exp(-G) over a chunk would overflow, the chunked form must not."""
    q, k, v, g, beta, S0 = make_inputs(1, 130, KDAGate.SOFTPLUS, seed=7)
    g = -300 * torch.rand(g.shape, generator=torch.Generator().manual_seed(1)) ** 4
    g[:, 40:60] = 0.0
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=S0)
    o, s = kda_chunk(q, k, v, g, beta, initial_state=S0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert max_err(o, o_ref) < 1e-4 and max_err(s, s_ref) < 1e-4


@pytest.mark.parametrize(("per_token", "block"), [(0.5, 64), (5.0, 32), (20.0, None)])
def test_intra_chunk_matrices_by_definition(per_token: float, block: int | None) -> None:
    """Each sub-chunk path: one matmul per 64- or 32-row block when the decay allows, else dyadic levels down to single rows."""
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(3, 64, 8, generator=gen), torch.randn(3, 64, 8, generator=gen)
    G = (-per_token * torch.rand(3, 64, 8, generator=gen)).cumsum(dim=1)
    s, offsets = _factor_block(G)
    assert (s if offsets is not None else None) == block, "each parameter must exercise its own path"
    Akk, Aqk = _intra_chunk(q, k, G)
    decay = (G[:, :, None, :] - G[:, None, :, :]).clamp(max=0).exp()  # [M, r, j, K]; only j <= r is read
    lower = torch.ones(64, 64, dtype=torch.bool).tril()
    expected_kk = torch.einsum("mrc,mjc,mrjc->mrj", k, k, decay) * lower.tril(-1)
    expected_qk = torch.einsum("mrc,mjc,mrjc->mrj", q, k, decay) * lower
    assert max_err(Akk, expected_kk) < 1e-4 and max_err(Aqk, expected_qk) < 1e-4


@pytest.mark.parametrize("impl", ["naive", "fast"])
@pytest.mark.parametrize("lengths", [[37, 64, 100], [1, 130, 0, 3, 64, 1, 65]])
def test_cu_seqlens_equals_separate_runs(impl: str, lengths: list[int]) -> None:
    """The second case is a serving step: sequences of 1 to 3 chunks in no particular order (ranks permute, sequences end at
    different chunk steps), single-token continuations and an empty sequence whose state must pass through unchanged."""
    parts = [make_inputs(1, n, KDAGate.LOWER_BOUND, seed=i) for i, n in enumerate(lengths)]
    q, k, v, g, beta, S0 = pack(parts)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    o, s = op("kda_prefill", impl)(q, k, v, g, beta, initial_state=S0, cu_seqlens=cu)
    assert o.shape == (1, sum(lengths), H, V) and s.shape == (len(lengths), H, K, V)
    for n, p in enumerate(parts):
        o_n, s_n = kda_recurrent(*p[:5], initial_state=p[5])
        if lengths[n]:
            assert max_err(o[:, cu[n] : cu[n + 1]], o_n) < 1e-4
        assert max_err(s[n], s_n[0]) < 1e-4


def test_bf16_inputs_close_to_fp32_reference() -> None:
    q, k, v, g, beta, S0 = make_inputs(1, 150, KDAGate.LOWER_BOUND, seed=3)
    q16, k16, v16, b16 = (x.to(torch.bfloat16) for x in (q, k, v, beta))
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=S0)
    o, s = kda_chunk(q16, k16, v16, g, b16, initial_state=S0)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert max_err(o, o_ref) < 5e-3 and max_err(s, s_ref) < 5e-3
    o_naive, _ = kda_recurrent(q16, k16, v16, g, b16, initial_state=S0)
    assert max_err(o_naive, o_ref) < 5e-3


def test_decode_step_equals_last_step_of_recurrence() -> None:
    q, k, v, g, beta, S0 = make_inputs(3, 20, KDAGate.SOFTPLUS, seed=5)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=S0)
    _, s_prefix = kda_recurrent(q[:, :-1], k[:, :-1], v[:, :-1], g[:, :-1], beta[:, :-1], initial_state=S0)
    before = s_prefix.clone()
    o, s = kda_decode(q[:, -1], k[:, -1], v[:, -1], g[:, -1], beta[:, -1], s_prefix)
    assert torch.equal(s_prefix, before), "kda_decode must not write its input state"
    assert max_err(o, o_ref[:, -1]) < 1e-5 and max_err(s, s_ref) < 1e-5


@pytest.mark.parametrize("gate", list(KDAGate))
def test_in_place_decode_equals_decode_and_recurrence(gate: KDAGate) -> None:
    """kda_decode_ reads the state once (both reads from the decayed-k/q trick) and advances it in place: same output and
    state as kda_decode, step after step, and as the recurrence over the whole sequence."""
    q, k, v, g, beta, S0 = make_inputs(3, 25, gate, seed=8)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=S0)
    state, functional = S0.clone(), S0.clone()
    outs = []
    for t in range(q.shape[1]):
        step = (q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        o_t = kda_decode_(*step, state)
        o_f, functional = kda_decode(*step, functional)
        assert max_err(o_t, o_f) < 1e-5 and max_err(state, functional) < 1e-5
        outs.append(o_t)
    assert max_err(torch.stack(outs, dim=1), o_ref) < 1e-5 and max_err(state, s_ref) < 1e-5


def test_in_place_decode_writes_through_a_pool_slice_and_checks_inputs() -> None:
    q, k, v, g, beta, S0 = make_inputs(2, 1, KDAGate.LOWER_BOUND, seed=9)
    pool = torch.zeros(5, H, K, V)
    pool[1:3] = S0
    _, want = kda_decode(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0)
    kda_decode_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], pool[1:3])
    assert max_err(pool[1:3], want) < 1e-6 and not pool[0].any() and not pool[3:].any()
    with pytest.raises(ValueError, match="fp32"):
        kda_decode_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0.double())
    with pytest.raises(ValueError, match=r"kda_decode_: state must be \[N, H, K, V\]"):
        kda_decode_(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], S0[:1])


def test_decode_loop_equals_recurrence() -> None:
    q, k, v, g, beta, S0 = make_inputs(2, 30, KDAGate.LOWER_BOUND, seed=6)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=S0)
    s = S0
    outs = []
    for t in range(q.shape[1]):
        o_t, s = kda_decode(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        outs.append(o_t)
    assert max_err(torch.stack(outs, dim=1), o_ref) < 1e-5 and max_err(s, s_ref) < 1e-5


def test_scale_argument_multiplies_q() -> None:
    q, k, v, g, beta, S0 = make_inputs(1, 70, KDAGate.LOWER_BOUND, seed=8)
    o1, _ = kda_chunk(q, k, v, g, beta, scale=0.5, initial_state=S0)
    o2, _ = kda_recurrent(q * (0.5 / K**-0.5), k, v, g, beta, initial_state=S0)
    assert max_err(o1, o2) < 1e-4


def gate_by_element(f, A_log, dt_bias, gate, lb):
    out = torch.empty_like(f)
    for idx in torch.cartesian_prod(*(torch.arange(n) for n in f.shape)).tolist():
        h, c = idx[-2], idx[-1]
        x = f[tuple(idx)].item() + dt_bias[h * f.shape[-1] + c].item()
        a = math.exp(A_log[h].item())
        out[tuple(idx)] = -a * math.log1p(math.exp(x)) if gate == KDAGate.SOFTPLUS else lb / (1 + math.exp(-a * x))
    return out


@pytest.mark.parametrize("gate", list(KDAGate))
def test_gate_formula(gate: KDAGate) -> None:
    gen = torch.Generator().manual_seed(0)
    f = 4 * torch.randn(2, 3, 2, 4, generator=gen)
    A_log = torch.randn(2, generator=gen)
    dt_bias = torch.randn(8, generator=gen)
    lb = -5.0 if gate == KDAGate.LOWER_BOUND else None
    g = kda_gate(f.to(torch.bfloat16), A_log, dt_bias, gate, lb)
    assert g.dtype == torch.float32 and g.shape == f.shape and (g <= 0).all()
    expected = gate_by_element(f.to(torch.bfloat16).float(), A_log, dt_bias, gate, lb)
    assert max_err(g, expected) < 1e-5
    same = kda_gate(f, A_log.view(1, 1, 2, 1), dt_bias.view(2, 4), gate, lb)
    assert torch.equal(same, kda_gate(f, A_log, dt_bias, gate, lb))


def test_gate_rejects_mismatched_arguments() -> None:
    f = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(f, torch.zeros(2), torch.zeros(8), KDAGate.LOWER_BOUND)
    with pytest.raises(ValueError, match="lower_bound"):
        kda_gate(f, torch.zeros(2), torch.zeros(8), KDAGate.SOFTPLUS, lower_bound=-5.0)
    with pytest.raises(ValueError, match="A_log"):
        kda_gate(f, torch.zeros(3), torch.zeros(8), KDAGate.SOFTPLUS)
    with pytest.raises(ValueError, match="dt_bias"):
        kda_gate(f, torch.zeros(2), torch.zeros(4), KDAGate.SOFTPLUS)


def test_prefill_op_dispatch_and_input_errors() -> None:
    assert op("kda_prefill", "naive") is kda_recurrent
    torch_forms = OpTarget(c_kernels=False)  # the C forms where they build: tests/ops/test_kda_chunk_c.py
    assert op("kda_prefill", "fast", torch_forms) is kda_chunk and op("kda_prefill", "auto", torch_forms) is kda_mixed  # one-token sequences split off
    assert op("kda_prefill", "auto", OpTarget(training=True)) is kda_chunk_autograd  # "auto" is resolved for the mode
    with pytest.raises(ValueError, match="'fast' is inference-only; for training choose one of \\['autograd', 'naive'\\]"):
        op("kda_prefill", "fast", OpTarget(training=True))
    with pytest.raises(ValueError, match="'triton' is unknown: expected one of .*autograd.*fast.*naive.*auto"):
        op("kda_prefill", "triton")
    q, k, v, g, beta, _ = make_inputs(2, 5, KDAGate.LOWER_BOUND)
    with pytest.raises(ValueError, match="B=1"):
        kda_chunk(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 2, 5]))
    with pytest.raises(ValueError, match="initial_state"):
        kda_chunk(q, k, v, g, beta, initial_state=torch.zeros(1, H, K, V))
    with pytest.raises(ValueError, match="chunk_size"):
        kda_chunk(q, k, v, g, beta, chunk_size=48)


def _kimi_linear():
    module = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear", reason="transformers with kimi_linear (>=5.24) is the peer oracle")
    # where fla is installed transformers swaps in fla's GPU kernels; the oracle is its own torch fallbacks beneath them
    names = ("recurrent_kimi_delta_attention", "chunk_kimi_delta_attention")
    fallbacks = {name: getattr(getattr(module, name), "__wrapped__", getattr(module, name)) for name in names}
    return SimpleNamespace(**fallbacks, KimiLinearForgetGate=module.KimiLinearForgetGate)


@pytest.mark.parametrize("gate", list(KDAGate))
def test_transformers_recurrent_and_chunk_agree(gate: KDAGate) -> None:
    """transformers' fallbacks take the same [B, T, H, *] layouts, fix scale = K^-0.5, and can L2-normalise q, k themselves."""
    kl = _kimi_linear()
    q, k, v, g, beta, S0 = make_inputs(2, 100, gate, seed=11)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, initial_state=S0)
    o_rec, s_rec = kl.recurrent_kimi_delta_attention(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    o_chk, s_chk = kl.chunk_kimi_delta_attention(q, k, v, g, beta, initial_state=S0, output_final_state=True)
    for o, s in ((o_rec, s_rec), (o_chk, s_chk)):
        assert max_err(o, o_ref) < 1e-4 and max_err(s, s_ref) < 1e-4
    raw_q, raw_k = 3 * torch.randn_like(q), 3 * torch.randn_like(k)
    o_in, s_in = kl.chunk_kimi_delta_attention(raw_q, raw_k, v, g, beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_out, s_out = kda_chunk(l2_norm(raw_q), l2_norm(raw_k), v, g, beta, initial_state=S0)
    assert max_err(o_in, o_out) < 1e-4 and max_err(s_in, s_out) < 1e-4


def test_transformers_forget_gate_matches_softplus_gate() -> None:
    """transformers' KimiLinearForgetGate (A_log stored [1, 1, H, 1], softplus linearised above 20) == f_b(f_a(x)) fed to kda_gate."""
    kl = _kimi_linear()
    module = kl.KimiLinearForgetGate(SimpleNamespace(linear_head_dim=K, linear_num_heads=H, hidden_size=24))
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p))
        x = 2 * torch.randn(2, 5, 24)
        theirs = module(x)
        f = module.f_b_proj(module.f_a_proj(x)).view(2, 5, H, K)
    assert module.A_log.shape == (1, 1, H, 1)
    assert max_err(kda_gate(f, module.A_log, module.dt_bias, KDAGate.SOFTPLUS), theirs) < 1e-5


@pytest.mark.parametrize("lengths", [[1, 130, 1, 3, 1], [1, 1, 1], [5, 64]])
def test_mixed_step_equals_recurrence(lengths: list[int]) -> None:
    """kda_mixed sends single-token sequences to the decode kernel and the rest to the chunked prefill; every sequence's
    output and final state must equal its own recurrence, whichever path it took."""
    parts = [make_inputs(1, n, KDAGate.SOFTPLUS, seed=10 + i) for i, n in enumerate(lengths)]
    q, k, v, g, beta, S0 = pack(parts)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    o, s = kda_mixed(q, k, v, g, beta, None, S0, cu)
    assert o.shape == (1, sum(lengths), H, V) and s.shape == (len(lengths), H, K, V)
    for n, p in enumerate(parts):
        o_n, s_n = kda_recurrent(*p[:5], initial_state=p[5])
        assert max_err(o[:, cu[n] : cu[n + 1]], o_n) < 1e-4
        assert max_err(s[n], s_n[0]) < 1e-4

"""The whole model: cache-free forward == prefill + decode through the cache, chunked prefill, packed batches, configs."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from openk3.config import Activation, KDAGate, debug, k3, kimi_linear_48b
from openk3.model import CacheTensors, ForwardBatch, K3ForCausalLM, OpChoice
from openk3.ops.cpu.build import kernels_available
from openk3.ops.kda import decode_fused, fla_kernels
from openk3.ops.kda.naive import kda_recurrent
from openk3.ops.registry import OpTarget

from .conftest import build

PAGE = 4
# Two fp32 evaluations of the same logits (|logits| up to ~3 with the std-0.1 test weights) in different orders -- cached
# step by step vs one forward, chunked vs recurrent KDA, 1 vs 2 threads -- each land within ~1e-4 of an fp64 forward
# (measured 3e-5 to 1e-4), so they may differ by up to twice that; a real cache bug moves logits by O(1).
TOL = 2e-4


def pages_for(n_seqs: int, pages_per_seq: int) -> torch.Tensor:
    # interleaved, non-contiguous page ids, so that a page-table bug cannot hide behind an identity layout
    ids = torch.arange(n_seqs * pages_per_seq).view(pages_per_seq, n_seqs).t().contiguous()
    return ids.flip(1)


def run_chunks(model: K3ForCausalLM, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """Feed one sequence through the cache in the given chunk sizes; return the logits of every position."""
    cache = CacheTensors.allocate(model.config, num_slots=3, num_pages=16, page_size=PAGE)
    table = pages_for(1, 16)
    out, pos = [], 0
    for n in chunks:
        batch = ForwardBatch.for_step([tokens[pos : pos + n]], [pos], [2], table, only_last_logits=False)
        out.append(model(batch, cache))
        pos += n
    assert pos == len(tokens)
    return torch.cat(out)


def test_prefill_then_decode_equals_full_forward(debug_model: K3ForCausalLM, decode_path: str) -> None:
    tokens = torch.randint(0, 256, (1, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = debug_model.forward_tokens(tokens)[0]
        stepwise = run_chunks(debug_model, tokens[0].tolist(), [9] + [1] * 14)
    torch.testing.assert_close(stepwise, full, atol=TOL, rtol=0)


@pytest.mark.parametrize("chunks", [[23], [1] * 23, [5, 7, 11], [16, 7]])
def test_chunked_prefill_equals_one_shot(debug_model: K3ForCausalLM, chunks: list[int]) -> None:
    tokens = torch.randint(0, 256, (23,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = debug_model.forward_tokens(torch.tensor([tokens]))[0]
        got = run_chunks(debug_model, tokens, chunks)
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)


def test_packed_batch_equals_separate_runs(debug_model: K3ForCausalLM) -> None:
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 12, 1)]
    cache = CacheTensors.allocate(debug_model.config, num_slots=4, num_pages=24, page_size=PAGE)
    table = pages_for(3, 8)
    with torch.no_grad():
        # dirty slots: a fresh sequence must read zeros whatever its slot holds
        for state in cache.kda_state + cache.conv_state:
            state.normal_()
        logits = debug_model(ForwardBatch.for_step(seqs, [0, 0, 0], [3, 0, 1], table), cache)
        for i, s in enumerate(seqs):
            alone = debug_model.forward_tokens(torch.tensor([s]))[0, -1]
            torch.testing.assert_close(logits[i], alone, atol=TOL, rtol=0)
        # one decode step for all three continues each sequence correctly
        nxt = [[7], [8], [9]]
        step = debug_model(ForwardBatch.for_step(nxt, [len(s) for s in seqs], [3, 0, 1], table), cache)
        for i, s in enumerate(seqs):
            alone = debug_model.forward_tokens(torch.tensor([s + nxt[i]]))[0, -1]
            torch.testing.assert_close(step[i], alone, atol=TOL, rtol=0)


def test_naive_ops_match_fast_ops() -> None:
    fast = build(debug())
    naive = K3ForCausalLM(debug(), OpChoice(kda="naive", conv="naive", mla="naive", moe="naive"))
    naive.load_state_dict(fast.state_dict())
    tokens = torch.randint(0, 256, (2, 70), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # different fp32 summation orders (chunked vs per-token KDA, SDPA vs einsum) drift by ~1e-5 per layer; logits reach ~3.4 here
        torch.testing.assert_close(naive.forward_tokens(tokens), fast.forward_tokens(tokens), atol=2e-4, rtol=1e-4)


def test_mla_decode_is_chosen_by_name(debug_model: K3ForCausalLM) -> None:
    """OpChoice.mla_decode names the paged decode attention; "auto" follows a "naive" prefill to the definition."""
    from openk3.model.mla import GatedMLA
    from openk3.ops.registry import op

    layers = [layer.self_attn for layer in debug_model.model.layers if isinstance(layer.self_attn, GatedMLA)]
    previous = debug_model.ops
    try:
        debug_model.select_ops(OpChoice(mla="naive"))
        assert layers and all(a.decode is op("mla_decode", "naive") for a in layers)
        debug_model.select_ops(OpChoice(mla_decode="naive"))
        assert all(a.decode is op("mla_decode", "naive") and a.prefill is op("mla_prefill", "auto") for a in layers)
        if kernels_available():
            debug_model.select_ops(OpChoice(mla="naive", mla_decode="fast"))  # an explicit name is kept under a naive prefill
            assert all(a.decode is op("mla_decode", "fast") and a.decode is not op("mla_decode", "naive") for a in layers)
        with pytest.raises(ValueError, match="mla_decode: implementation .no-such-kernel. is unknown"):
            debug_model.select_ops(OpChoice(mla_decode="no-such-kernel"))
    finally:
        debug_model.select_ops(previous)


def test_kimi_linear_features_switch_off() -> None:
    cfg = debug().replace(
        attn_res_block_size=None,
        hidden_act=Activation.SILU,
        kda=debug().kda.__class__(num_heads=2, head_dim=16, gate=KDAGate.SOFTPLUS),
        mla=debug().mla.__class__(num_heads=2, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        moe=debug().moe.__class__(num_experts=8, num_experts_per_token=2, moe_intermediate_size=32, routed_scaling_factor=2.446),
    )
    model = build(cfg)
    names = set(model.state_dict())
    assert not any("_res_" in n or "routed_expert" in n or n.endswith("self_attn.g_proj.weight") for n in names)
    assert "model.layers.0.self_attn.g_a_proj.weight" in names and "model.layers.4.self_attn.q_proj.weight" in names
    tokens = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model.forward_tokens(tokens)[0]
        steps = run_chunks(model, tokens[0].tolist(), [6] + [1] * 11)
    torch.testing.assert_close(steps, full, atol=TOL, rtol=0)


@pytest.mark.parametrize("preset", [k3, kimi_linear_48b])
def test_full_size_model_builds_on_meta_and_matches_param_count(preset) -> None:
    config = preset()
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    n = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    assert n == config.param_count().total


def test_k3_param_count_matches_spec() -> None:
    total, active = k3().param_count()
    assert f"{total / 1e12:.4g}" == "2.779" and f"{active / 1e9:.4g}" == "104.2"
    total, active = kimi_linear_48b().param_count()
    assert 47e9 < total < 50e9 and 2.8e9 < active < 3.3e9


def fake_fla(calls: list[tuple[str, int, int]]) -> SimpleNamespace:
    """fla.ops.kda's two kernels by their contract, computed by openk3's recurrence on CPU: V-first states in and out
    (as the seam hands them), sequences cut by cu_seqlens. What the model sends fla is what is under test, not fla."""

    def kernel(name: str) -> Any:
        def run(q, k, v, g, beta, *, scale, initial_state, output_final_state, state_v_first, cu_seqlens):  # type: ignore[no-untyped-def]
            assert output_final_state and state_v_first
            calls.append((name, q.shape[1], 1 if cu_seqlens is None else cu_seqlens.numel() - 1))
            init = None if initial_state is None else initial_state.transpose(-1, -2)
            o, state = kda_recurrent(q, k, v, g, beta, scale, init, cu_seqlens)
            return o, state.transpose(-1, -2).contiguous()

        return run

    return SimpleNamespace(chunk_kda=kernel("chunk_kda"), fused_recurrent_kda=kernel("fused_recurrent_kda"))


@pytest.fixture(params=["cpu kernel", "torch ops", "fla kernels (fake)"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, debug_model: K3ForCausalLM) -> Iterator[str]:
    """The serving decode step runs the fused CPU kernel (ops/kda/decode_fused.py: the "c" backend's "kda_decode"), the
    torch ops (chosen with OpTarget(c_kernels=False)), or with kda="fla" (CUDA's) fla's fused recurrence over one-token
    sequences, faked here on CPU: the decode tests run all three, and each checks that its kernel really ran."""
    if request.param == "fla kernels (fake)":
        fla_calls: list[tuple[str, int, int]] = []
        monkeypatch.setattr(fla_kernels, "_fla_kda", lambda: fake_fla(fla_calls))
        previous = debug_model.ops
        debug_model.select_ops(OpChoice(kda="fla"), target=OpTarget(device="cuda"))  # CPU tensors: the fake runs anywhere
        yield request.param
        debug_model.select_ops(previous)
        decode_calls = [c for c in fla_calls if c[0] == "fused_recurrent_kda"]
        assert decode_calls and all(tokens == seqs for _, tokens, seqs in decode_calls), fla_calls  # one token per sequence
        return
    if request.param == "torch ops":
        debug_model.select_ops(target=OpTarget(c_kernels=False))
        yield request.param
        debug_model.select_ops()
        return
    if not kernels_available():
        pytest.skip("no C compiler: the kernel cannot be built here")
    kernel = decode_fused._kernel()
    calls: list[int] = []

    def counted(*args: Any) -> Any:
        calls.append(args[0])
        return kernel(*args)

    monkeypatch.setattr(decode_fused, "_kernel", lambda: counted)
    yield request.param
    assert calls, "the decode steps did not reach the fused kernel"


@pytest.mark.parametrize("slots", [[0, 1, 2], [2, 0, 3]])
def test_decode_step_of_fresh_sequences_on_dirty_slots(debug_model: K3ForCausalLM, slots: list[int], decode_path: str) -> None:
    """1-token prompts make a decode step (is_decode) of sequences with no context: whether the slots are consecutive (the
    state is advanced through a slice of the pool) or not (gathered and written back), they start from zero state."""
    cache = CacheTensors.allocate(debug_model.config, num_slots=4, num_pages=24, page_size=PAGE)
    table = pages_for(3, 8)
    prompts = [[11], [200], [42]]
    with torch.no_grad():
        for s in cache.kda_state + cache.conv_state:
            s.normal_()
        batch = ForwardBatch.for_step(prompts, [0, 0, 0], slots, table)
        assert batch.is_decode and (batch.slot_range is not None) == (slots == [0, 1, 2])
        first = debug_model(batch, cache)
        second = debug_model(ForwardBatch.for_step([[5], [6], [7]], [1, 1, 1], slots, table), cache)
        for i, p in enumerate(prompts):
            alone = debug_model.forward_tokens(torch.tensor([p + [5 + i]]))[0]
            torch.testing.assert_close(first[i], alone[0], atol=TOL, rtol=0)
            torch.testing.assert_close(second[i], alone[1], atol=TOL, rtol=0)


@pytest.mark.parametrize("slots", [[1, 2, 3], [2, 0, 1]])
def test_decode_step_mixing_fresh_and_continuing_sequences(debug_model: K3ForCausalLM, slots: list[int], decode_path: str) -> None:
    cache = CacheTensors.allocate(debug_model.config, num_slots=4, num_pages=24, page_size=PAGE)
    table = pages_for(3, 8)
    prompt = [9, 8, 7, 6, 5]
    with torch.no_grad():
        for s in cache.kda_state + cache.conv_state:
            s.normal_()
        debug_model(ForwardBatch.for_step([prompt], [0], [slots[0]], table[:1]), cache)
        batch = ForwardBatch.for_step([[4], [100], [200]], [len(prompt), 0, 0], slots, table)
        assert batch.is_decode and (batch.slot_range is not None) == (slots == [1, 2, 3])
        got = debug_model(batch, cache)
        for i, seq in enumerate([prompt + [4], [100], [200]]):
            torch.testing.assert_close(got[i], debug_model.forward_tokens(torch.tensor([seq]))[0, -1], atol=TOL, rtol=0)

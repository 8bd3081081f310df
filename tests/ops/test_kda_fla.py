"""KDA and fla: openk3's prefill forms against fla's own pure-torch references (a peer oracle), and the fla entries'
seam (ops/kda/fla_kernels.py): the state layout conversion round-trips and the entries hand fla V-first states and
give openk3 back its own layout. fla's kernels themselves need a GPU; benchmarks/gpu/run.sh runs them there."""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from openk3.ops.kda import fla_kernels
from openk3.ops.kda.chunk import kda_chunk
from openk3.ops.kda.fla_kernels import StateLayout, convert_state
from openk3.ops.kda.naive import assert_cu_seqlens_on_device, kda_recurrent
from openk3.ops.registry import OpTarget, registry

B, T, H, K, V = 2, 37, 2, 16, 8


def inputs(seed: int = 0, batch: int = B, tokens: int = T) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    q, k = F.normalize(r(batch, tokens, H, K), dim=-1), F.normalize(r(batch, tokens, H, K), dim=-1)
    log_decay = -F.softplus(r(batch, tokens, H, K))  # the gate's range: <= 0
    beta = torch.sigmoid(r(batch, tokens, H))
    return q, k, r(batch, tokens, H, V), log_decay, beta, r(batch, H, K, V)


def test_state_layout_round_trips() -> None:
    state = torch.randn(3, H, K, V)
    fla_state = convert_state(state, StateLayout.KEY_FIRST, StateLayout.VALUE_FIRST)
    assert fla_state.shape == (3, H, V, K) and fla_state.is_contiguous() and torch.equal(fla_state[1, 0], state[1, 0].T)
    assert torch.equal(convert_state(fla_state, StateLayout.VALUE_FIRST, StateLayout.KEY_FIRST), state)
    assert convert_state(state, StateLayout.KEY_FIRST, StateLayout.KEY_FIRST) is state
    with pytest.raises(ValueError, match="expected"):
        convert_state(state[0], StateLayout.KEY_FIRST, StateLayout.VALUE_FIRST)


def fla_naive() -> Any:
    return pytest.importorskip("fla.ops.kda.naive", reason="fla (flash-linear-attention, the gpu extra) is not installed")


@pytest.mark.parametrize("form", [kda_recurrent, kda_chunk])
def test_openk3_prefill_equals_fla_references(form: Any) -> None:
    """fla's naive_recurrent_kda (the recurrence) and naive_chunk_kda (its chunkwise reference, T a multiple of 64)."""
    naive = fla_naive()
    q, k, v, g, beta, s0 = inputs()
    o, s = form(q, k, v, g, beta, 0.5, s0)
    o_ref, s_ref = naive.naive_recurrent_kda(q, k, v, g, beta, 0.5, s0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-5)
    q, k, v, g, beta, s0 = inputs(seed=1, tokens=64)
    o, s = form(q, k, v, g, beta, None, s0)
    o_ref, s_ref = naive.naive_chunk_kda(q, k, v, g, beta, None, s0, output_final_state=True)
    torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s, s_ref, atol=1e-4, rtol=1e-4)


def fake_fla_kernel(seen: list[dict[str, Any]]) -> Any:
    """fla's kernel contract on CPU, by its naive recurrence: V-first states when asked, sequences cut by cu_seqlens."""
    naive = fla_naive()

    def kernel(q, k, v, g, beta, *, scale, initial_state, output_final_state, state_v_first, cu_seqlens):  # type: ignore[no-untyped-def]
        seen.append({"state_v_first": state_v_first, "state_shape": None if initial_state is None else tuple(initial_state.shape)})
        assert output_final_state
        s0 = None if initial_state is None else (initial_state.transpose(-1, -2) if state_v_first else initial_state)
        spans = [(0, q.shape[1])] if cu_seqlens is None else list(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True))
        outs, states = [], []
        for n, (a, b) in enumerate(spans):
            part = [t[:, a:b] if cu_seqlens is not None else t for t in (q, k, v, g, beta)]
            init = None if s0 is None else (s0[n : n + 1] if cu_seqlens is not None else s0)
            o, s = naive.naive_recurrent_kda(*part, scale, init, output_final_state=True)
            outs.append(o)
            states.append(s)
        final = torch.cat(states)
        return torch.cat(outs, dim=1), final.transpose(-1, -2).contiguous() if state_v_first else final

    return kernel


@pytest.mark.parametrize("entry", ["fla", "fla_recurrent"])
def test_fla_entries_convert_states_at_the_seam(entry: str, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[dict[str, Any]] = []
    kernel = fake_fla_kernel(seen)
    monkeypatch.setattr(fla_kernels, "_fla_kda", lambda: SimpleNamespace(chunk_kda=kernel, fused_recurrent_kda=kernel))
    fn = registry().get("kda_prefill", entry, OpTarget("cuda"))
    q, k, v, g, beta, _ = inputs(batch=1)
    cu = torch.tensor([0, 5, 5, 37])
    s0 = torch.randn(3, H, K, V)
    o, s = fn(q, k, v, g, beta, 0.5, s0, cu)
    o_ref, s_ref = kda_recurrent(q, k, v, g, beta, 0.5, s0, cu)
    torch.testing.assert_close(o, o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-5)
    assert seen == [{"state_v_first": True, "state_shape": (3, H, V, K)}]


def test_missing_fla_is_a_clear_error_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.import_module

    def no_fla(name: str, package: str | None = None) -> Any:
        if name.startswith("fla"):
            raise ImportError(f"No module named {name!r}")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", no_fla)
    q, k, v, g, beta, s0 = inputs()
    with pytest.raises(ImportError, match=r"openk3\[gpu\]"):
        registry().get("kda_prefill", "fla", OpTarget("cuda"))(q, k, v, g, beta, None, s0)
    assert registry().entry("kda_prefill", "auto", OpTarget("cuda"))[0] == "mixed"  # fla is chosen by name, never by default


def test_an_fla_without_a_keyword_the_seam_passes_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """fla's entries take **kwargs and drop unknown names: an fla whose kernel lacks state_v_first (fla-core before 0.5.2
    called it transpose_state_layout) would run with the state in the wrong layout, so the seam refuses it by name."""

    def old_kernel(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, transpose_state_layout=False, cu_seqlens=None, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("must not be called")

    monkeypatch.setattr(fla_kernels, "_fla_kda", lambda: SimpleNamespace(chunk_kda=old_kernel, fused_recurrent_kda=old_kernel))
    q, k, v, g, beta, s0 = inputs()
    for entry in ("fla", "fla_recurrent"):
        with pytest.raises(ImportError, match="has no parameter state_v_first .*ignore it silently"):
            registry().get("kda_prefill", entry, OpTarget("cuda"))(q, k, v, g, beta, None, s0)


def test_cu_seqlens_are_asserted_on_their_device() -> None:
    """On CUDA the KDA entries (fla's seam included) check cu_seqlens with a device-side assertion instead of reading it back
    every call; on CPU the same assertion fails at once, which is how it is tested here."""
    assert_cu_seqlens_on_device(torch.tensor([0, 5, 5, 37]), 37)
    for bad in ([1, 5, 37], [0, 5, 36], [0, 6, 5, 37]):
        with pytest.raises(RuntimeError, match=r"cu_seqlens must be \[N\+1\], non-decreasing from 0 to T=37"):
            assert_cu_seqlens_on_device(torch.tensor(bad), 37)

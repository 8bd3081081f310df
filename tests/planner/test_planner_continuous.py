"""In-flight batching (issue 37 item 1): the mixed step, the steady state's identities, and a finite run step by step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from openk3.config import k3
from openk3.planner.continuous import _prefill, finite_run, steady_state
from openk3.planner.hardware import load_catalogue
from openk3.planner.inputs import Balance, Layout, Quantisation, Workload
from openk3.planner.models import qwen3_30b_a3b
from openk3.planner.overheads import Overheads
from openk3.planner.perf import Efficiency, Scenario, batch_step, evaluate, prefill_step
from openk3.planner.steps import PrefillChunk
from openk3.planner.validation_agg import QWEN_FP4
from openk3.planner.workload import RequestMix, demand


def _sc(concurrency: int, context: int = 1500, eff: Efficiency | None = None) -> Scenario:
    workload = Workload(context=context, concurrency=concurrency, prompt=1000)
    return Scenario(qwen3_30b_a3b(), QWEN_FP4, Layout(1), workload, load_catalogue().system("hgx-b200"), eff or Efficiency())


def _by_name(step: object) -> dict[str, object]:
    return {c.name: c for c in step.components}  # type: ignore[attr-defined]


def test_a_mixed_step_reads_the_weights_once_and_runs_its_gemms_at_the_sum() -> None:
    sc = _sc(256)
    chunk = PrefillChunk(tokens=2000, prompts=2, mean_keys=500.5, prompt_tokens=1000)
    mixed, decode = batch_step(sc, 256, chunk), batch_step(sc, 256)
    pre = prefill_step(sc.with_(workload=Workload(context=1000, concurrency=1, prompt=1000, prefill_chunk=1000)))
    m, d = _by_name(mixed), _by_name(decode)
    assert m["trunk"].bytes == d["trunk"].bytes  # type: ignore[attr-defined]
    assert m["trunk"].flops == pytest.approx(d["trunk"].flops * (256 + 2000) / 256)  # type: ignore[attr-defined]
    # the chunk's own attention is its own kernel: 2 prompts' causal pairs, as two 1,000-token prefill steps price them
    assert m["attention_prefill"].flops == pytest.approx(2 * _by_name(pre)["attention"].flops)  # type: ignore[attr-defined]
    assert m["attention"].flops == d["attention"].flops  # type: ignore[attr-defined]
    # dearer than decoding alone, cheaper than decoding and then prefilling the same prompts in steps of their own
    assert decode.total_s < mixed.total_s < decode.total_s + 2 * pre.total_s


def test_a_mixed_step_runs_eager_at_its_real_batch() -> None:
    sc = _sc(300, eff=Efficiency.measured())  # captured graphs: 256, 384; a decode step of 300 runs padded to 384
    chunk = PrefillChunk(tokens=1, prompts=1, mean_keys=1, prompt_tokens=1)
    assert _by_name(batch_step(sc, 300))["attention"].bytes == pytest.approx(384 / 300 * _by_name(batch_step(sc, 300, chunk))["attention"].bytes)  # type: ignore[attr-defined]


def test_the_eager_launch_cost_is_charged_to_mixed_steps_only() -> None:
    """`Overheads.eager_s_per_layer` (off by default; benchmarks/planner_eager.py tries it): a mixed step runs outside the
    captured graphs and pays it once per layer; a decode step replays a graph and does not."""
    base = Efficiency.measured()
    eager = replace(base, overheads=replace(base.step_overheads, eager_s_per_layer=1e-4))
    chunk = PrefillChunk(tokens=500, prompts=1, mean_keys=250.5, prompt_tokens=1000)
    layers = qwen3_30b_a3b().num_hidden_layers
    assert base.step_overheads.eager_s_per_layer == 0.0
    assert batch_step(_sc(256, eff=eager), 256, chunk).total_s == pytest.approx(batch_step(_sc(256, eff=base), 256, chunk).total_s + layers * 1e-4)
    assert batch_step(_sc(256, eff=eager), 256).total_s == batch_step(_sc(256, eff=base), 256).total_s
    with pytest.raises(ValueError, match="eager_s_per_layer"):
        Overheads(eager_s_per_layer=-1.0)


def test_steady_state_holds_littles_law_slots_and_budget() -> None:
    sc = _sc(100)
    st = steady_state(sc, isl=100, osl=101, token_budget=10_000)
    # the budget is ample, so every slot decodes but the one prompt in flight: lam (osl - 1) + lam = 100
    assert st.limit == "requests"
    assert st.requests_per_step == pytest.approx(100 / 101)
    assert st.decode_rows == pytest.approx(100 * 100 / 101)
    assert st.mixed_share == pytest.approx(100 / 101)  # fewer than one prompt arrives per step: one prompt per mixed step
    assert st.chunk.tokens == 100
    assert st.output_tok_s == pytest.approx(st.requests_per_step * 101 / st.step_s)
    tight = steady_state(_sc(1000), isl=1000, osl=100, token_budget=2000)  # 1,000 slots, but 2,000 tokens per step
    assert tight.limit == "token budget"
    assert tight.decode_rows + tight.requests_per_step * 1000 == pytest.approx(2000)
    assert tight.decode_rows + tight.requests_per_step * tight.prompt_steps < 1000
    with pytest.raises(ValueError, match="token_budget"):
        steady_state(sc, 100, 100, 0)


def test_prefill_fills_the_budget_first_come_first_served_and_chunks_the_last() -> None:
    waiting = [[3.0, 0.0], [2.0, 0.0]]
    done, tokens, prompts, pairs = _prefill(waiting, 25, isl=10)
    assert (done, tokens, prompts) == (2, 25, 3)
    assert waiting == [[1, 5.0], [2.0, 0.0]]
    assert pairs == pytest.approx(2 * 10 * 5.5 + 5 * 3)  # whole prompts: 10 x (10 + 1) / 2 each; the chunk: 5 x 3
    done, tokens, prompts, pairs = _prefill(waiting, 100, isl=10)
    assert (done, tokens, prompts, waiting) == (3, 25, 3, [])
    assert pairs == pytest.approx(5 * (5 + 3) + 2 * 55)


def test_a_finite_run_step_by_step() -> None:
    """2 slots, 4 requests of 10 + 3 tokens, budget 100: prompts (both) | decode | decode, twice: 6 steps, 12 tokens."""
    sc = _sc(2)
    run = finite_run(sc, isl=10, osl=3, token_budget=100, requests=4)
    assert run.steps == 6
    prompts = batch_step(sc, 0, PrefillChunk(tokens=20, prompts=2, mean_keys=5.5, prompt_tokens=10)).total_s
    decode = batch_step(sc, 2).total_s
    assert run.seconds == pytest.approx(2 * (prompts + 2 * decode))
    assert run.output_tok_s == pytest.approx(12 / run.seconds)


def test_a_long_finite_run_approaches_the_steady_state() -> None:
    sc = _sc(64)
    short = finite_run(sc, isl=500, osl=50, token_budget=4096, requests=64)
    long = finite_run(sc, isl=500, osl=50, token_budget=4096, requests=64 * 200)
    assert short.output_tok_s < long.output_tok_s  # the start and the drain weigh on a run of one batch
    assert long.output_tok_s == pytest.approx(long.steady.output_tok_s, rel=0.05)


def test_the_headline_plan_priced_by_mixed_steps_agrees_with_separate_ones() -> None:
    """docs/planner.md (per-operator section): the issue's headline plan (K3, GB300, 8K/1K, 72 acc TP2 x DP36, 31
    sequences per group) served as mixed steps gives within a few % of the workload's separate prefill and decode
    steps: at 31 decode rows per group a mixed step saves one decode step's weight read against an 8K prompt's prefill.
    The steady state is a little faster, never slower, and the same decode rows pay a prefill-long step once per prompt."""
    mix = RequestMix(((8192, 1024),), None)
    layout = Layout(72, tp=2, balance=Balance.MOONEP)
    sc = Scenario(k3(), Quantisation(), layout, Workload(mix.decode_context, 31 * layout.dp, prompt=8192), load_catalogue().system("gb300-nvl72"))
    d = demand(sc, evaluate(sc), mix)
    st = steady_state(sc, 8192, 1024, token_budget=8192)
    assert st.prompt_steps == pytest.approx(1.0, abs=0.01) and st.mixed.total_s > 20 * st.decode.total_s  # ~a prompt a step
    rps = st.output_tok_s / 1024
    assert d.replica_rps < rps < 1.03 * d.replica_rps
    assert d.user_tok_s < 1 / st.step_s < 1.03 * d.user_tok_s

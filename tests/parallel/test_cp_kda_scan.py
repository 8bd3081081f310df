"""Context-parallel prefill with `kda_scan` (parallel/cp/kda_scan.py: every rank's KDA recurrence at once, the state maps
composed by a log-depth scan): logits, prompt logprobs, the KDA states and conv windows, the MLA pages and the prefix cache's cut states
equal one process to fp32 rounding (the scan reorders additions, so not bitwise: measured up to 1.6e-4 on these
random-weight logits, the order of the 0.6-1.6e-4 between one step and chunks; states to ~4e-7, conv windows and
latents, which see the earlier layers' rounding, to ~4e-5), and greedy tokens are the same -- on 2 and 3 gloo ranks,
fresh and after a context; each rank receives one map per scan round and no state hand-off; the config refuses the scan
without CP."""

from __future__ import annotations

import pytest
import torch

from openk3.config import debug
from openk3.parallel.config import ParallelConfig
from openk3.parallel.cp.exchange import shard_bounds
from openk3.parallel.launch import run_ranks
from openk3.planner.inputs import Quantisation
from openk3.planner.pp_cp import KDASplit, cp_bytes
from tests.parallel.cp_cases import scan_cases

LENGTHS = (5, 150)
CONTEXT = 21
WORLDS = (2, 3)
TOLERANCE = {"logits": 5e-4, "prompt_logprobs": 5e-4, "kda_state": 1e-5, "conv_state": 1e-4, "mla_latent": 2e-4}


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict[str, dict[str, float]]]]:
    return {world: run_ranks(scan_cases, world, LENGTHS, CONTEXT) for world in WORLDS}


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ["5", "150", "150+ctx"])
def test_the_scan_equals_one_process(results, world: int, case: str) -> None:
    for rank, by_case in enumerate(results[world]):
        e = by_case[case]
        for key, most in TOLERANCE.items():
            assert e[key] <= most, f"rank {rank}: {key} differs by {e[key]}"
        assert e["mismatched_tokens"] == 0 and e["mismatched_whole_tokens"] == 0, f"rank {rank}"
        assert e["untouched_pages"] == 0 and e["attn_modules_restored"] == 1


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ["fresh", "context"])
def test_the_cut_states_under_the_scan_equal_one_process(results, world: int, case: str) -> None:
    for rank, by_case in enumerate(results[world]):
        e = by_case[f"cuts:{case}"]
        assert e["kda_state"] <= TOLERANCE["kda_state"] and e["conv_state"] <= TOLERANCE["conv_state"], f"rank {rank}: {e}"
        assert e["cut_slots_filled"] == 1, f"rank {rank}"


@pytest.mark.distributed
@pytest.mark.parametrize("world", WORLDS)
def test_each_rank_receives_one_map_per_scan_round_and_no_state(results, world: int) -> None:
    """Per KDA layer rank r receives its predecessor's map, then one per doubling round whose sender r - s is >= 1
    (kda_scan.predecessors); the busiest rank's count is the planner's kda_hops_per_layer."""
    cfg = debug()
    n_kda = cfg.num_hidden_layers - len(cfg.mla_layers)
    h, k = cfg.kda.num_heads, cfg.kda.head_dim
    conv = 4 * 3 * cfg.kda.proj_dim * (cfg.kda.conv_kernel - 1)
    kda_map = 4 * h * k * (k + k)  # [H, K, V + K], V = K
    for rank, _ in enumerate(shard_bounds(150, world)):
        e = results[world][rank]["150"]
        maps = (rank > 0) + sum(rank - s >= 1 for s in (1, 2, 4) if s < world - 1)
        assert e["kda_scan_bytes"] == n_kda * maps * kda_map, f"rank {rank}"
        assert e["kda_conv_bytes"] == (n_kda * conv if rank > 0 else 0)
        assert e["kda_bytes"] == e["kda_conv_bytes"]  # no recurrent state handed on
    busiest = max(results[world][r]["150"]["kda_scan_bytes"] for r in range(world)) / n_kda / kda_map
    assert busiest == cp_bytes(cfg, Quantisation(cache_dtype_bytes=4), tp=1, prompt=150, cp=world, kda=KDASplit.SCAN).kda_hops_per_layer


def test_the_scan_needs_context_parallelism() -> None:
    with pytest.raises(ValueError, match="kda_cp='scan' needs context parallelism"):
        ParallelConfig(kda_cp="scan")
    assert ParallelConfig(cp=2, kda_cp="scan").kda_cp == "scan"


@pytest.mark.distributed
def test_the_engine_with_the_scan_gives_one_process_tokens() -> None:
    """LLM(cp=3, kda_cp="scan") on the demo model: greedy and seeded tokens equal one process, prompt logprobs to 1e-4,
    and the long prompt's chunks ran split."""
    from openk3.llm import LLM
    from tests.parallel.test_llm_cp import ENGINE, cp_step, run

    torch.set_num_threads(1)
    want = run(LLM("tiny", **ENGINE))
    llm = LLM("tiny", cp=3, kda_cp="scan", cp_min_tokens=32, **ENGINE)
    step = cp_step(llm)
    assert step is not None and step.kda_scan, "rank 0 runs the scan"
    got = run(llm)
    for key in ("batched", "seeded", "alone"):
        assert got[key] == want[key], key
    assert got["scored_cp_steps"] == 3
    assert got["prompt_logprobs"] == pytest.approx(want["prompt_logprobs"], abs=1e-4)

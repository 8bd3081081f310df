"""EP outputs equal the single-process outputs (fp32, 1e-5) on 2 and 4 gloo ranks: plain EP, EPLB placement, the MoonEP plan
(also with a prefetch budget that forces spills, and with a packed MXFP4 bank), skewed routings, and a whole debug model.

One spawn per world size runs every case (process start-up dominates on CPU) and returns per-case errors.
"""

from __future__ import annotations

import pytest

from openk3.parallel.launch import run_ranks
from tests.parallel.ep_cases import ROUTINGS, all_cases

pytestmark = pytest.mark.distributed

WORLDS = (2, 4)


@pytest.fixture(scope="module")
def results() -> dict[int, list[dict[str, float | str]]]:
    return {world: run_ranks(all_cases, world) for world in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", ["ep", "eplb", "moonep", "moonep_budget0", "moonep_packed"])
@pytest.mark.parametrize("routing", ROUTINGS)
def test_moe_layer_matches_single_process(results, world: int, method: str, routing: str) -> None:
    for rank, errors in enumerate(results[world]):
        assert errors[f"moe/{method}/{routing}"] <= 1e-5, f"rank {rank}"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_moonep_gives_every_rank_the_same_slots(results, world: int, routing: str) -> None:
    for errors in results[world]:
        # ceil(entries / W) slots per rank; the last rank takes the remainder, so loads differ by less than W entries.
        assert errors[f"moe/moonep/{routing}/imbalance"] < world
        assert errors[f"moe/moonep_packed/{routing}/prefetch_bytes_mismatch"] == 0


@pytest.mark.parametrize("world", WORLDS)
def test_prefetch_budget_below_epn_spills_and_stays_exact(results, world: int) -> None:
    # No prefetch budget: every remote segment goes back home (plain EP by another road); exactness is checked above.
    assert any(results[world][0][f"moe/moonep_budget0/{kind}/spilled"] > 0 for kind in ROUTINGS)


@pytest.mark.parametrize("world", WORLDS)
def test_eplb_from_collected_load(results, world: int) -> None:
    for errors in results[world]:
        assert errors["moe/eplb_collected/zipf"] <= 1e-5


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", ["ep", "eplb", "moonep"])
def test_debug_model_forward_matches_single_process(results, world: int, method: str) -> None:
    for errors in results[world]:
        assert errors[f"model/{method}"] <= 1e-5
        assert errors[f"model/{method}/stats_layers"] == 0


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", ["ep", "eplb", "moonep"])
def test_replicated_attention_token_split_matches_single_process(results, world: int, method: str) -> None:
    # 3 x 7 = 21 tokens do not split evenly over 2 or 4 ranks, so the padded gather is exercised.
    for errors in results[world]:
        assert errors[f"model/replicated_{method}"] <= 1e-5
    # Every rank holds bitwise the same logits, so greedy sampling agrees across ranks without a broadcast.
    assert len({errors[f"model/replicated_{method}/digest"] for errors in results[world]}) == 1


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", ["ep", "eplb", "moonep"])
@pytest.mark.parametrize("feed", ["replicated", "dp"])
def test_greedy_decode_through_the_cache_matches_single_process(results, world: int, method: str, feed: str) -> None:
    for errors in results[world]:
        assert errors[f"model/greedy_{feed}_{method}"] <= 1e-5
        assert errors[f"model/greedy_{feed}_{method}/mismatched_tokens"] == 0

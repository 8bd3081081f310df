"""Measured expert load: the file an engine exports, its validation, and EPLB placements from it (the heaviest experts get
the replicas, the hottest rank's load drops against plain EP); without a file EPLB refuses to start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from openk3.config import debug
from openk3.model import K3ForCausalLM
from openk3.model.moe import LocalExperts
from openk3.parallel.ep.load_stats import (
    STATS_NEEDED,
    ExpertLoad,
    LoadStatsError,
    RecordingExperts,
    eplb_engine_placements,
)
from openk3.parallel.ep.placement import LoadCollector, Placement, contiguous_placement

E = 16


def skewed(layers: list[int]) -> ExpertLoad:
    # Layer-specific hot experts: 5 (and 11) in the first layer, 2 in the others; the rest share a small uniform load.
    out = {}
    for n, layer in enumerate(layers):
        counts = torch.full((E,), 10, dtype=torch.int64)
        if n == 0:
            counts[5], counts[11] = 900, 400
        else:
            counts[2] = 700
        out[layer] = counts
    return ExpertLoad(E, 64, out)


def rank_loads(placement: Placement, load_E: torch.Tensor) -> torch.Tensor:
    """Entries each rank computes when every expert's load splits evenly over its replicas."""
    per_replica = load_E.double() / placement.replica_counts()
    return per_replica[placement.phys_to_log].sum(1)


def ranks_holding(placement: Placement, expert: int) -> set[int]:
    return {r for r in range(placement.num_ranks) if expert in placement.phys_to_log[r].tolist()}


def body(**fields: object) -> str:
    return json.dumps({"format": "openk3-expert-load", "version": 1, "num_experts": E, "window_steps": 1, **fields})


def test_save_load_round_trip(tmp_path: Path) -> None:
    load = skewed([1, 3])
    load.save(tmp_path / "load.json")
    back = ExpertLoad.load(tmp_path / "load.json")
    assert back.num_experts == E and back.window_steps == 64
    assert sorted(back.layers) == [1, 3] and all(torch.equal(back.layers[i], load.layers[i]) for i in (1, 3))


def test_from_collector_counts_entries_over_the_window() -> None:
    collector = LoadCollector(4, window=2)
    for step in range(3):
        collector.observe(1, torch.tensor([[step % 4, 3]]))
    load = ExpertLoad.from_collector(collector)
    assert load.window_steps == 2
    assert load.layers[1].tolist() == [0, 1, 1, 2]  # steps 1 and 2 only


def test_eplb_heaviest_experts_get_the_replicas_and_the_hottest_rank_cools(tmp_path: Path) -> None:
    path = tmp_path / "load.json"
    skewed([1, 3]).save(path)
    ranks = 4
    placements = eplb_engine_placements([1, 3], E, ranks, path, redundant_fraction=0.1)  # 16 + 4 physical experts
    plain = contiguous_placement(E, ranks)
    load = skewed([1, 3]).layers
    first = placements[1].replica_counts()
    assert int(first.sum()) == 20
    assert int(first[5]) == 4 and int(first[11]) == 2  # 900 -> 4 replicas (225 each) beats 400 -> 2 (200 each)
    assert int((first > 1).sum()) == 2
    assert int(placements[3].replica_counts()[2]) == 4 and int(placements[3].replica_counts().sum()) == 20
    for layer in (1, 3):
        assert rank_loads(placements[layer], load[layer]).max() < rank_loads(plain, load[layer]).max()
        assert ranks_holding(placements[layer], int(torch.argmax(load[layer]))) == {0, 1, 2, 3}  # one replica per rank


def test_eplb_without_a_stats_file_is_an_error() -> None:
    with pytest.raises(ValueError, match="needs a stats file"):
        eplb_engine_placements([1], E, 2, None, 0.1)
    assert "--eplb-stats FILE" in STATS_NEEDED


@pytest.mark.parametrize(
    "text, message",
    [
        ("not json", "cannot read it as JSON"),
        (json.dumps({"format": "other", "version": 1}), "expected format 'openk3-expert-load'"),
        (body(), "'layers'"),
        (body(layers={"1": [1] * 3}), r"layer 1 has \(3,\) counts"),
        (body(layers={"1": [-1] * E}), "negative counts"),
        (body(layers={"1": ["many"] * E}), "layer '1' must map a layer index to a list of integer counts"),
    ],
)
def test_bad_files_are_refused_naming_the_problem(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "load.json"
    path.write_text(text)
    with pytest.raises(LoadStatsError, match=message):
        ExpertLoad.load(path)


def test_a_file_for_another_model_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "load.json"
    skewed([1]).save(path)
    with pytest.raises(LoadStatsError, match="no counts for MoE layers \\[3\\]"):
        eplb_engine_placements([1, 3], E, 2, path, 0.1)
    with pytest.raises(LoadStatsError, match="num_experts=16, the model has 8"):
        eplb_engine_placements([1], 8, 2, path, 0.1)
    ExpertLoad(E, 0, {1: torch.zeros(E, dtype=torch.int64)}).save(path)
    with pytest.raises(LoadStatsError, match="counted no tokens"):
        eplb_engine_placements([1], E, 2, path, 0.1)


def test_recording_experts_measures_a_run_without_changing_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = K3ForCausalLM(debug())
    model.init_weights(seed=0, std=0.1)
    model.eval()
    tokens = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model.forward_tokens(tokens)
        collector = LoadCollector(model.config.moe.num_experts, window=8)
        model.set_expert_backend(RecordingExperts(LocalExperts(), collector))
        got = model.forward_tokens(tokens)
    assert torch.equal(got, want)
    layers = [m.layer_index for m in model.moe_layers()]
    load = ExpertLoad.from_collector(collector)
    assert sorted(load.layers) == layers and load.window_steps == 1
    k = model.config.moe.num_experts_per_token
    assert all(int(load.layers[i].sum()) == tokens.numel() * k for i in layers)
    load.save(tmp_path / "load.json")
    placements = eplb_engine_placements(layers, model.config.moe.num_experts, 2, tmp_path / "load.json", 0.1)
    assert sorted(placements) == layers

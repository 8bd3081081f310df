"""What each rank loads from a checkpoint: bank row i holds global expert phys_to_log[r][i], for every method and rank.

In process, without spawning: load_model(experts=...) is called once per simulated rank and compared, row by row, with the
model loaded in full. Includes 3 ranks (EPLB's uneven split) and a placement giving one rank two copies of an expert.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from openk3.config import debug
from openk3.model import K3ForCausalLM
from openk3.model.weights import load_model, save_model
from openk3.parallel.ep.placement import Placement, balanced_pack, eplb_placement, replicate
from openk3.parallel.serving.rank_model import engine_placements, rank_expert_ids
from tests.parallel.test_eplb_stats import skewed_load_file


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = K3ForCausalLM(debug())
    model.init_weights(seed=11, std=0.1)
    model.quantize_experts()  # packed MXFP4 banks (codes + scales), as K3 ships them
    folder = tmp_path_factory.mktemp("rank_experts")
    save_model(model, folder)
    return folder


@pytest.fixture(scope="module")
def full(checkpoint: Path) -> K3ForCausalLM:
    return load_model(checkpoint)


def expert_tensors(model: K3ForCausalLM, layer: int) -> dict[str, torch.Tensor]:
    moe = {m.layer_index: m for m in model.moe_layers()}[layer]
    return dict(list(moe.experts.named_parameters()) + list(moe.experts.named_buffers()))


def check_ranks(checkpoint: Path, full: K3ForCausalLM, placements: dict[int, Placement]) -> None:
    for rank in range(next(iter(placements.values())).num_ranks):
        ids = rank_expert_ids(placements, rank)
        local = load_model(checkpoint, experts=ids)
        for layer, layer_ids in ids.items():
            want, got = expert_tensors(full, layer), expert_tensors(local, layer)
            assert set(got) == set(want)
            for name, bank in got.items():
                assert bank.shape[0] == len(layer_ids), (rank, layer, name)
                for row, e in enumerate(layer_ids):
                    assert torch.equal(bank[row], want[name][e]), f"rank {rank} layer {layer} {name} row {row}: expected expert {e}"


@pytest.mark.parametrize(("method", "ranks"), [("eplb", 2), ("eplb", 3), ("moonep", 2)])
def test_each_rank_bank_row_is_its_placed_expert(checkpoint: Path, full: K3ForCausalLM, method: str, ranks: int, tmp_path: Path) -> None:
    layers = [m.layer_index for m in full.moe_layers()]
    stats = skewed_load_file(tmp_path / "load.json") if method == "eplb" else None  # eplb places the measured hot experts
    check_ranks(checkpoint, full, engine_placements(layers, debug().moe.num_experts, ranks, method, stats))


def test_a_rank_holding_two_copies_of_an_expert_loads_both(checkpoint: Path, full: K3ForCausalLM) -> None:
    table = torch.tensor([[0, 0, 1, 2, 3], [4, 5, 6, 7, 7]])  # a hand-made table: from_table allows it, the loader must too
    layers = [m.layer_index for m in full.moe_layers()]
    check_ranks(checkpoint, full, dict.fromkeys(layers, Placement.from_table(table, 8)))


def test_expert_ids_are_checked(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"layer 1 lists expert id 8, expected ids in 0\.\.7"):
        load_model(checkpoint, experts={1: [0, 8]})
    with pytest.raises(ValueError, match=r"layer 2 lists expert id -1"):
        load_model(checkpoint, experts={2: [-1]})
    with pytest.raises(ValueError, match=r"layers \[0\] are not MoE layers"):
        load_model(checkpoint, experts={0: [1]})


def test_eplb_never_puts_two_copies_of_an_expert_on_one_rank() -> None:
    # tiny's shape at ep=3 (16 experts + 2 redundant): the unconstrained packing put both replicas of expert 0 on rank 2
    weights = torch.tensor([1.0] * 14 + [0.5] * 4)
    groups = torch.tensor(list(range(2, 16)) + [0, 0, 1, 1])
    plain = balanced_pack(weights, 3)
    assert plain[14] == plain[15], "without groups the two replicas of expert 0 share a pack (what the groups prevent)"
    grouped = balanced_pack(weights, 3, groups)
    assert grouped[14] != grouped[15] and grouped[16] != grouped[17]
    assert torch.bincount(grouped).tolist() == [6, 6, 6]
    assert torch.bincount(balanced_pack(torch.ones(4), 2, torch.zeros(4, dtype=torch.long))).tolist() == [2, 2], "no way out: share"
    skew = torch.arange(1, 17).float().pow(-1.5) * 1000
    for load, ranks, redundant in [(torch.ones(16), 3, 2), (torch.ones(896), 64, 128), (skew, 4, 4), (skew, 2, 6)]:
        table = eplb_placement(load, ranks, redundant).phys_to_log
        for r, row in enumerate(table.tolist()):
            assert len(set(row)) == len(row), (ranks, redundant, r, row)


def test_replicate_caps_replicas() -> None:
    assert replicate(torch.tensor([10.0, 1, 1, 1]), 6, max_replicas=2).tolist() == [2, 2, 1, 1]
    with pytest.raises(ValueError, match="num_physical=9 exceeds num_experts=4 x max_replicas=2"):
        replicate(torch.ones(4), 9, max_replicas=2)

"""Expert shards (dense and packed MXFP4) survive the prefetch wire format; on one rank every backend equals the local MoE."""

from __future__ import annotations

import pytest
import torch

from openk3.ops.moe.bank import DenseExpertBank
from openk3.ops.moe.grouped import moe_experts_grouped
from openk3.ops.moe.packed_bank import PackedMXFP4ExpertBank
from openk3.parallel.ep.backend import EPBackend
from openk3.parallel.ep.moonep_backend import MoonEPBackend
from openk3.parallel.ep.placement import eplb_placement
from openk3.parallel.ep.shard import ExpertShard, SlotBank
from openk3.parallel.ep.static_backend import ExpertParallelBackend
from openk3.parallel.group import ParallelContext
from tests.parallel.ep_cases import ROUTINGS, make_layer, make_routing

E, I, D = 6, 64, 32


def banks() -> tuple[DenseExpertBank, PackedMXFP4ExpertBank]:
    g = torch.Generator().manual_seed(0)
    w1, w3, w2 = (torch.randn(*s, generator=g) * 0.1 for s in ((E, I, D), (E, I, D), (E, D, I)))
    return DenseExpertBank(w1, w3, w2), PackedMXFP4ExpertBank.from_dense(w1, w3, w2)


@pytest.mark.parametrize("kind", ["dense", "packed"])
def test_shard_bytes_round_trip(kind: str) -> None:
    dense, packed = banks()
    bank = dense if kind == "dense" else packed
    shard = ExpertShard.from_bank(bank, torch.tensor([4, 1, 5]))
    assert shard.expert_nbytes == (3 * I * D * 4 if kind == "dense" else 3 * I * D * (1 / 2 + 1 / 32))
    wire = shard.to_bytes(torch.tensor([2, 0]))
    assert wire.dtype == torch.uint8 and wire.shape == (2, shard.expert_nbytes)
    back = shard.from_bytes(wire)
    assert type(back) is type(bank) and back.num_experts == 2
    slots = SlotBank(shard.bank, back)
    for slot, global_id in enumerate([4, 1, 5, 5, 4]):
        for got, want in zip(slots.expert(slot, torch.float32), bank.expert(global_id, torch.float32), strict=True):
            assert torch.equal(got, want)
    with pytest.raises(IndexError, match="slot 5"):
        slots.expert(5, torch.float32)
    with pytest.raises(ValueError, match="expected"):
        shard.from_bytes(wire[:, :-1])


def test_shard_loaded_from_checkpoint_keys_equals_shard_cut_from_bank() -> None:
    _, packed = banks()
    entries = packed.state_dict_entries("model.layers.3.block_sparse_moe.")
    ids = torch.tensor([5, 2])
    loaded = ExpertShard.from_checkpoint(entries, ids, "model.layers.3.block_sparse_moe.")
    cut = ExpertShard.from_bank(packed, ids)
    assert isinstance(loaded.bank, PackedMXFP4ExpertBank) and isinstance(cut.bank, PackedMXFP4ExpertBank)
    assert torch.equal(loaded.to_bytes(torch.arange(2)), cut.to_bytes(torch.arange(2)))
    del entries["model.layers.3.block_sparse_moe.experts.2.w3.weight_scale"]
    with pytest.raises(KeyError, match=r"experts\.2\.w3\.weight_scale"):
        ExpertShard.from_checkpoint(entries, ids, "model.layers.3.block_sparse_moe.")


@pytest.mark.parametrize("routing", ROUTINGS)
def test_single_rank_backends_equal_local_moe(routing: str) -> None:
    torch.set_grad_enabled(False)
    try:
        layer = make_layer(8)
        ctx = ParallelContext.single()
        z = torch.randn(11, 32, generator=torch.Generator().manual_seed(0))
        r = make_routing(routing, 11, 8, 3, seed=1)
        ref = moe_experts_grouped(z, r.topk_idx, r.topk_weight, layer.experts.bank(), layer.expert_act)
        placement = eplb_placement(torch.bincount(r.topk_idx.reshape(-1), minlength=8).float(), 1, 3)
        backends: list[EPBackend] = [
            ExpertParallelBackend.from_layers(ctx, [layer]),
            ExpertParallelBackend.from_layers(ctx, [layer], {1: placement}),
            MoonEPBackend.from_layers(ctx, [layer], pad=4),
        ]
        for backend in backends:
            torch.testing.assert_close(backend(layer, z, r), ref, atol=1e-5, rtol=0)
            stats = backend.drain_stats()
            assert len(stats) == 1 and stats[0].recv_entries_R == (33,) and stats[0].recv_rows_R == (11,)
    finally:
        torch.set_grad_enabled(True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_single_rank_backends_on_cuda_keep_tensors_on_the_device() -> None:
    # Never run on the CPU-only dev machine: it guards the device moves in the exchange and the MoonEP prefetch.
    torch.set_grad_enabled(False)
    try:
        layer = make_layer(8).cuda()
        ctx = ParallelContext.single("cuda")
        z = torch.randn(11, 32, generator=torch.Generator().manual_seed(0)).cuda()
        r = make_routing("zipf", 11, 8, 3, seed=1)
        r = type(r)(*(t.cuda() for t in r))
        ref = moe_experts_grouped(z, r.topk_idx, r.topk_weight, layer.experts.bank(), layer.expert_act)
        for backend in (ExpertParallelBackend.from_layers(ctx, [layer]), MoonEPBackend.from_layers(ctx, [layer], pad=4)):
            y = backend(layer, z, r)
            assert y.device == z.device
            torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_grad_enabled(True)


def test_errors_name_the_layer_and_values() -> None:
    layer = make_layer(8)
    ctx = ParallelContext.single()
    backend = MoonEPBackend.from_layers(ctx, [layer])
    other = make_layer(8)
    other.layer_index = 4
    r = make_routing("uniform", 3, 8, 3, seed=0)
    with pytest.raises(KeyError, match="MoE layer 4"):
        backend(other, torch.zeros(3, 32), r)
    with pytest.raises(ValueError, match="prefetch_budget_bytes=-1"):
        MoonEPBackend(ctx, backend.shards, prefetch_budget_bytes=-1)
    with pytest.raises(ValueError, match="rank=2, world_size=2"):
        ParallelContext(2, 2, torch.device("cpu"), None)

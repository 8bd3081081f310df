"""The serving layout (serve/prepare.py, serve/fused.py): the prepared model computes what the plain one does (up to fp32
summation order: one matmul over the concatenated rows), every way of changing its weights is seen by the fused blocks
(nothing to go stale), anything that moves a weight out falls back to the per-weight path until prepared again, tying costs
no memory, and the model's own classes and state_dict keys are untouched."""

from __future__ import annotations

import copy

import pytest
import torch

from openk3.config import debug
from openk3.model import load_model, save_model
from openk3.model.kda import KimiDeltaAttention
from openk3.model.layers import Linear, ProjectionGroup, StackedWeights
from openk3.model.weights import cast_model
from openk3.ops import linear as linear_mod
from openk3.ops.registry import OpTarget
from openk3.serve.prepare import FusedProjections, FusedWeights, PackedLinear, prepare_for_serving
from tests.model.conftest import build

CPU = torch.device("cpu")

TOKENS = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(3))


def groups(model) -> list[FusedProjections | FusedWeights]:
    return [m for m in model.modules() if isinstance(m, (FusedProjections, FusedWeights))]


def fused_blocks(model) -> list[torch.Tensor]:
    return [g.block.tensor for g in groups(model) if g.block.tensor is not None]


def all_blocks_in_use(model) -> bool:
    """Every group was swapped for its serving form and its block still backs its parameters (the fast path runs)."""
    if any(type(m) in (ProjectionGroup, StackedWeights) for m in model.modules()):
        return False
    with torch.no_grad():
        for g in groups(model):
            weights = [m.weight for m in g.members]
            if g.block.rows(weights) is None:
                return False
    return True


def kda_layer(model) -> KimiDeltaAttention:
    layer = model.model.layers[0].self_attn
    assert isinstance(layer, KimiDeltaAttention)
    return layer


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.forward_tokens(TOKENS)


def test_tied_model_equals_untied_and_costs_no_memory() -> None:
    plain, tied = build(debug()), build(debug())
    storages_before = {p.untyped_storage().data_ptr() for p in tied.parameters()}
    bytes_before = sum(p.numel() * p.element_size() for p in tied.parameters())
    prepare_for_serving(tied, CPU)
    assert all_blocks_in_use(tied) and len(groups(tied)) == 4 * 2 + 2 + 3  # debug(): 4 KDA (in + conv), 2 MLA, 3 MLPs
    torch.testing.assert_close(logits(tied), logits(plain), atol=1e-4, rtol=1e-4)
    # the weights now live in fewer storages whose total size equals the parameters' bytes: no second copy
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in tied.parameters()}
    assert len(storages) < len(storages_before)
    assert sum(storages.values()) == bytes_before
    assert tied.state_dict().keys() == plain.state_dict().keys()


def test_weight_changes_reach_the_fused_blocks() -> None:
    tied, other = build(debug()), build(debug(), seed=7)
    prepare_for_serving(tied, CPU)
    tied.load_state_dict(other.state_dict())
    assert all_blocks_in_use(tied)
    torch.testing.assert_close(logits(tied), logits(other), atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        for p in tied.parameters():
            p.data.mul_(0.5)  # through .data: no version counter moves, the shared storage still does
        for p in other.parameters():
            p.mul_(0.5)
    torch.testing.assert_close(logits(tied), logits(other), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("fused_adam", [False, True])
def test_training_steps_on_a_tied_model(fused_adam: bool) -> None:
    """Autograd takes the per-weight path (gradients reach q_proj etc.), and the optimizer's in-place updates -- including
    the fused AdamW kernel, which bumps no version counter -- are what the next no_grad forward computes with."""
    tied, plain = build(debug()), build(debug())
    prepare_for_serving(tied, CPU)
    from openk3.ops.registry import OpTarget

    for model in (tied, plain):
        model.select_ops(target=OpTarget(training=True))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=fused_adam) for m in (tied, plain)]
    for _ in range(2):
        for model, opt in zip((tied, plain), opts, strict=True):
            opt.zero_grad()
            model.forward_tokens(TOKENS).float().logsumexp(-1).mean().backward()
            opt.step()
    q = kda_layer(tied)
    assert q.q_proj.weight.grad is not None and q.q_proj.weight.grad.abs().sum() > 0
    assert all_blocks_in_use(tied)
    torch.testing.assert_close(logits(tied), logits(plain), atol=1e-4, rtol=1e-4)


def test_moving_weights_out_falls_back_until_prepared_again() -> None:
    tied, plain = build(debug()), build(debug())
    prepare_for_serving(tied, CPU)
    kda = kda_layer(tied)
    kda.q_proj.weight.data = kda.q_proj.weight.data.clone()  # new storage: that block can no longer stand in
    assert not all_blocks_in_use(tied)
    torch.testing.assert_close(logits(tied), logits(plain), atol=1e-4, rtol=1e-4)
    tied.double()  # .to()-style conversions release every block at once (no dead copy kept alive) ...
    plain.double()
    for model in (tied, plain):  # ... and the ops are chosen again for what the model now is
        model.select_ops(target=OpTarget(dtype=torch.float64))
    assert fused_blocks(tied) == []
    torch.testing.assert_close(logits(tied), logits(plain), atol=1e-9, rtol=1e-9)
    prepare_for_serving(tied, CPU)  # ... and preparing again ties them
    assert all_blocks_in_use(tied)
    torch.testing.assert_close(logits(tied), logits(plain), atol=1e-9, rtol=1e-9)
    cast_model(tied, torch.bfloat16)
    cast_model(plain, torch.bfloat16)
    torch.testing.assert_close(logits(tied).float(), logits(plain).float(), atol=1e-2, rtol=1e-2)
    plain.select_ops(target=OpTarget(dtype=torch.bfloat16))  # what preparing chooses for bf16 (the MLA prefill: "latent")
    prepare_for_serving(tied, CPU)
    assert all_blocks_in_use(tied)
    torch.testing.assert_close(logits(tied).float(), logits(plain).float(), atol=1e-2, rtol=1e-2)


def test_copies_saves_and_inference_mode_loads(tmp_path) -> None:
    tied = build(debug())
    prepare_for_serving(tied, CPU)
    want = logits(tied)
    clone = copy.deepcopy(tied)  # parameters are copied one by one: the copy starts untied (no dead block) and is correct
    assert not all_blocks_in_use(clone)
    torch.testing.assert_close(logits(clone), want, atol=1e-4, rtol=1e-4)
    prepare_for_serving(clone, CPU)
    assert all_blocks_in_use(clone)
    torch.testing.assert_close(logits(clone), want, atol=0, rtol=0)
    save_model(tied, tmp_path / "ckpt")
    with torch.inference_mode():  # a model loaded and tied under inference mode serves
        loaded = load_model(tmp_path / "ckpt")
        prepare_for_serving(loaded, CPU)
        torch.testing.assert_close(loaded.forward_tokens(TOKENS), want, atol=1e-4, rtol=1e-4)
    blocks = fused_blocks(loaded)
    assert blocks and not any(b.is_inference() for b in blocks)  # tying does not turn weights into inference tensors


def test_share_memory_keeps_the_blocks_and_assign_releases_them() -> None:
    tied, other = build(debug()), build(debug(), seed=5)
    prepare_for_serving(tied, CPU)
    blocks = fused_blocks(tied)
    tied.share_memory()  # moves the blocks' storage in place: nothing to re-tie, the weights stay shared
    assert all(p.is_shared() for p in tied.parameters()) and all_blocks_in_use(tied)
    assert [b.data_ptr() for b in fused_blocks(tied)] == [b.data_ptr() for b in blocks]
    tied.load_state_dict(other.state_dict(), assign=True)  # new tensors: every block is left behind, and released
    torch.testing.assert_close(logits(tied), logits(other), atol=1e-4, rtol=1e-4)
    assert fused_blocks(tied) == []


def packed_copies(model) -> int:
    """How many of the model's packed linears and fused blocks hold a packed copy now (ops/linear.py PackedWeight: oneDNN's
    layout, or the C kernel's panels, which take these 26-row steps where the C kernels build)."""
    holders = [m.packed for m in model.modules() if isinstance(m, PackedLinear)] + [g.block.packed for g in groups(model)]
    return sum(h._packed is not None or h._panels is not None for h in holders)


def test_packed_weights_follow_every_weight_change(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU serving's packed copies are made on use and rebuilt after load_state_dict, in-place writes and .to()."""
    if linear_mod._reorder is None:
        pytest.skip("this torch build has no oneDNN weight reorder")
    monkeypatch.setattr(linear_mod, "LARGE_WEIGHT", 2**10)  # the debug model's projections are below the real threshold
    tied, other, plain = build(debug()), build(debug(), seed=7), build(debug())
    prepare_for_serving(tied, CPU, pack_cpu_weights=True)
    assert tied.state_dict().keys() == plain.state_dict().keys()
    swapped = [m for m in tied.modules() if isinstance(m, PackedLinear)]
    members = {id(lin) for g in groups(tied) for lin in g.members}
    assert swapped and not any(type(m) is Linear and m.bias is None and id(m) not in members for m in tied.modules())
    torch.testing.assert_close(logits(tied), logits(plain), atol=1e-4, rtol=1e-4)  # 26 rows: above SMALL_ROWS
    assert packed_copies(tied) >= 10
    tied.load_state_dict(other.state_dict())
    torch.testing.assert_close(logits(tied), logits(other), atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        for model in (tied, other):
            for p in model.parameters():
                p.mul_(0.5)
    torch.testing.assert_close(logits(tied), logits(other), atol=1e-4, rtol=1e-4)
    tied.double()
    other.double()
    assert packed_copies(tied) == 0  # the old copies are dropped with the old weights
    for model in (tied, other):
        model.select_ops(target=OpTarget(dtype=torch.float64))
    torch.testing.assert_close(logits(tied), logits(other), atol=1e-9, rtol=1e-9)  # fp64: the plain path
    tied.float()
    other.float()
    other.select_ops()
    prepare_for_serving(tied, CPU, pack_cpu_weights=True)
    torch.testing.assert_close(logits(tied), logits(other), atol=1e-4, rtol=1e-4)
    assert packed_copies(tied) >= 10


def test_the_model_classes_stay_plain_and_gpu_gets_no_packed_copies() -> None:
    model = build(debug())
    with pytest.raises(ValueError, match="pack_cpu_weights: oneDNN's packed weights are for CPU fp32 inference, not cuda"):
        prepare_for_serving(model, torch.device("cuda"), pack_cpu_weights=True)  # asked for where it cannot apply: an error
    prepare_for_serving(model, torch.device("cuda"))  # the layout is chosen for the target device
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    fresh = build(debug())
    assert any(type(m) is ProjectionGroup for m in fresh.modules())  # building a model applies no serving layout
    assert not any(isinstance(m, (FusedProjections, FusedWeights, PackedLinear)) for m in fresh.modules())


def test_packing_keeps_the_module_and_a_training_model_keeps_its_choices() -> None:
    from openk3.model import OpChoice
    from openk3.model.kda import KimiDeltaAttention
    from openk3.model.moe import LocalExperts
    from openk3.ops.kda.chunk_autograd import kda_chunk_autograd
    from openk3.ops.moe.naive import moe_experts_naive
    from openk3.ops.registry import OpTarget

    model = build(debug())
    o_proj = kda_layer(model).o_proj
    o_proj.tag = "mine"  # type: ignore[assignment]
    calls: list[int] = []
    o_proj.register_forward_pre_hook(lambda m, args: calls.append(1))
    moe = model.moe_layers()[0]
    moe.backend = LocalExperts("naive")  # a name set on the backend itself
    model.select_ops(target=OpTarget(training=True))
    model.train()
    prepare_for_serving(model, CPU, pack_cpu_weights=True)
    assert kda_layer(model).o_proj is o_proj and isinstance(o_proj, PackedLinear) and o_proj.tag == "mine"
    logits(model)
    assert calls  # its hooks still run
    assert {m.kda_prefill for m in model.modules() if isinstance(m, KimiDeltaAttention)} == {kda_chunk_autograd}
    assert isinstance(moe.backend, LocalExperts) and moe.backend.op is moe_experts_naive
    with pytest.raises(ValueError, match="OpChoice.kda_chunk_size=5 is invalid: expected None or a power of two"):
        OpChoice(kda_chunk_size=5)

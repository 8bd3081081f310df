"""The served latent MoE layer (serve/fused_moe.py): on CPU with packed weights and the C kernels, a decode-sized step runs
the layer after its router as one C call, and its output equals the layer's own forward bit for bit -- for one row, a few
and PANEL_ROWS, after weight writes (the panel copies follow them) and in the whole model's logits; wherever the separate
calls would run other kernels (more rows, autograd, another expert backend, dense experts) or a hook would be skipped, the
layer's own forward runs."""

from __future__ import annotations

import pytest
import torch

from openk3.config import debug
from openk3.model.moe import LatentMoE, LocalExperts
from openk3.ops.cpu.build import kernels_available
from openk3.ops.registry import OpTarget
from openk3.ops.thresholds import PANEL_ROWS
from openk3.serve.fused_moe import ServedLatentMoE
from openk3.serve.prepare import prepare_for_serving
from tests.model.conftest import build

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the C kernels do not build here")
CPU = torch.device("cpu")


def served_model():
    model = build(debug())
    model.quantize_experts()
    prepare_for_serving(model, CPU, pack_cpu_weights=True)
    return model


def served_layers(model) -> list[ServedLatentMoE]:
    layers = [m for m in model.modules() if isinstance(m, LatentMoE)]
    assert layers and all(type(m) is ServedLatentMoE for m in layers)
    return layers  # type: ignore[return-value]


def rows(t: int, seed: int) -> torch.Tensor:
    return torch.randn(t, debug().hidden_size, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("t", [1, 5, 16, PANEL_ROWS])
def test_one_call_equals_the_layers_own_forward_bit_for_bit(t: int) -> None:
    model = served_model()
    with torch.no_grad():
        for i, layer in enumerate(served_layers(model)):
            x = rows(t, seed=t + i)
            assert layer.block_weights(x) is not None  # the one call runs
            assert torch.equal(layer(x), LatentMoE.forward(layer, x))


def test_weight_writes_reach_the_one_call() -> None:
    model = served_model()
    layer = served_layers(model)[0]
    x = rows(16, seed=1)
    with torch.no_grad():
        before = layer(x)
        shared = layer.shared_experts
        assert shared is not None
        for lin in (layer.routed_expert_down_proj, layer.routed_expert_up_proj, shared.gate_proj, shared.down_proj):
            lin.weight.mul_(0.5)
        after = layer(x)
        assert not torch.equal(before, after)
        assert torch.equal(after, LatentMoE.forward(layer, x))


def test_the_whole_model_gives_the_same_logits() -> None:
    model = served_model()
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))  # 18 rows: one call per layer
    with torch.no_grad():
        fused = model.forward_tokens(tokens)
        for layer in served_layers(model):
            layer.__class__ = LatentMoE  # type: ignore[assignment]
        plain = model.forward_tokens(tokens)
    assert torch.equal(fused, plain)


def test_other_steps_run_the_layers_own_forward() -> None:
    model = served_model()
    layer = served_layers(model)[0]
    with torch.no_grad():
        assert layer.block_weights(rows(PANEL_ROWS + 1, seed=2)) is None  # above the panel kernel's rows
    assert layer.block_weights(rows(4, seed=2)) is None  # autograd on
    with torch.no_grad():
        layer.backend = LocalExperts("naive")  # the experts' definition named: the one call would not reproduce it
        assert layer.block_weights(rows(4, seed=2)) is None
        layer.backend = LocalExperts()
        assert layer.block_weights(rows(4, seed=2)) is not None
        layer.routed_expert_down_proj.select(OpTarget(), "naive")  # F.linear named for one projection
        assert layer.block_weights(rows(4, seed=2)) is None
        layer.routed_expert_down_proj.select(OpTarget())
        assert layer.block_weights(rows(4, seed=2)) is not None
        handle = layer.routed_expert_up_proj.register_forward_hook(lambda m, args, out: None)  # a hook the one call would skip
        assert layer.block_weights(rows(4, seed=2)) is None
        handle.remove()
    dense = build(debug())
    prepare_for_serving(dense, CPU, pack_cpu_weights=True)
    with torch.no_grad():
        assert all(m.block_weights(rows(4, seed=2)) is None for m in served_layers(dense))  # dense experts: not the packed loop


def test_the_router_runs_in_the_call_unless_something_wraps_it() -> None:
    """The router's top-k runs inside the one call ("moe_routed_latent_block") while the layer routes with the C router as
    chosen; a `route` set on the layer (a benchmark's recorder) or another router function on the gate (routing replay)
    is called instead, and the block runs on what it returns. The output is the layer's own forward's in every case."""
    model = served_model()
    layer = served_layers(model)[0]
    x = rows(16, seed=4)
    calls: list[str] = []
    routed, own_route = layer.routed_block, layer.route

    def counted_block(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("routed block")
        return routed(*args, **kwargs)

    def wrapped_route(x_TD):  # type: ignore[no-untyped-def]
        calls.append("route")
        return own_route(x_TD)

    with torch.no_grad():
        want = LatentMoE.forward(layer, x)
        layer.routed_block = counted_block
        assert torch.equal(layer(x), want) and calls == ["routed block"]
        layer.route = wrapped_route  # type: ignore[method-assign]
        assert torch.equal(layer(x), want) and calls == ["routed block", "route"]
        del layer.route
        chosen = layer.gate.route
        layer.gate.route = lambda *args: chosen(*args)
        assert torch.equal(layer(x), want) and calls == ["routed block", "route"]

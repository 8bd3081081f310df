"""ops/registry.py: implementations by (op, name, device), "auto" resolved once for a target, and the model choosing by
name through it (select_ops) instead of a hidden switch or a monkeypatch."""

from __future__ import annotations

import pytest
import torch

from openk3.config import debug
from openk3.model import K3ForCausalLM, OpChoice
from openk3.model.kda import KimiDeltaAttention
from openk3.ops.kda.chunk import kda_chunk
from openk3.ops.kda.chunk_autograd import kda_chunk_autograd
from openk3.ops.registry import OpRegistry, OpTarget, registry
from openk3.serve.prepare import prepare_for_serving


def toy() -> OpRegistry:
    r = OpRegistry()
    r.register("add", "naive", lambda a, b: a + b, "the definition", differentiable=True)
    r.register("add", "fast", lambda a, b: "any-device fast", "fast anywhere")
    r.register("add", "fast", lambda a, b: "cpu fast", "the CPU backend", device="cpu")
    r.register_auto("add", lambda t: "naive" if t.training else "fast")
    return r


def test_a_device_backend_is_preferred_and_auto_follows_the_target() -> None:
    r = toy()
    assert r.get("add", "fast", OpTarget("cpu"))(1, 2) == "cpu fast"
    assert r.get("add", "fast", OpTarget("cuda"))(1, 2) == "any-device fast"
    assert r.get("add", "auto", OpTarget("cuda", training=True))(1, 2) == 3
    assert r.names("add") == ["fast", "naive", "auto"]


def test_errors_name_the_choices() -> None:
    r = toy()
    with pytest.raises(ValueError, match=r"add: implementation 'x' is unknown: expected one of \['fast', 'naive', 'auto'\]"):
        r.get("add", "x")
    with pytest.raises(ValueError, match=r"'fast' is inference-only; for training choose one of \['naive'\]"):
        r.get("add", "fast", OpTarget(training=True))
    with pytest.raises(ValueError, match="already registered"):
        r.register("add", "naive", lambda a, b: a, "again")
    with pytest.raises(ValueError, match="'auto' is a rule"):
        r.register("add", "auto", lambda a, b: a, "no")
    with pytest.raises(ValueError, match="unknown op 'mul'"):
        r.names("mul")


def test_every_builtin_op_has_a_differentiable_reference() -> None:
    r = registry()
    for name in ("kda_prefill", "short_conv", "mla_prefill", "moe_experts", "attn_res"):
        assert r.entry(name, "naive")[1].differentiable, name
        assert "auto" in r.names(name)


def kda_prefills(model: K3ForCausalLM) -> set[object]:
    return {m.kda_prefill for m in model.modules() if isinstance(m, KimiDeltaAttention)}


def test_the_model_chooses_by_name_for_training_and_for_serving() -> None:
    model = K3ForCausalLM(debug())
    assert kda_prefills(model) == {kda_chunk}  # built for CPU inference
    model.select_ops(target=OpTarget(training=True))
    assert kda_prefills(model) == {kda_chunk_autograd}  # "auto" for training: the differentiable form
    model.init_weights(0)
    model.forward_tokens(torch.randint(0, 256, (1, 6))).sum().backward()  # and it differentiates
    prepare_for_serving(model, torch.device("cpu"))
    assert kda_prefills(model) == {kda_chunk_autograd}  # a module in training mode keeps what its owner chose
    prepare_for_serving(model.eval(), torch.device("cpu"))
    assert kda_prefills(model) == {kda_chunk}  # an eval-mode one gets "auto" resolved again, for inference
    with pytest.raises(ValueError, match="'fast' is inference-only"):
        model.select_ops(OpChoice(kda="fast"), OpTarget(training=True))

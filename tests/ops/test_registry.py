"""ops/registry.py: implementations by (op, name, backend), "auto" resolved once for a target, and the model choosing by
name through it (select_ops) instead of a hidden switch, a per-call kernel check or a monkeypatch."""

from __future__ import annotations

import pytest
import torch

from openk3.config import debug
from openk3.model import K3ForCausalLM, OpChoice
from openk3.model.kda import KimiDeltaAttention
from openk3.ops.cpu.build import kernels_available
from openk3.ops.kda.chunk_autograd import kda_chunk_autograd
from openk3.ops.kda.chunk_c import kda_mixed_c
from openk3.ops.kda.mixed import kda_mixed
from openk3.ops.registry import OpRegistry, OpTarget, registry
from openk3.serve.prepare import prepare_for_serving


def toy() -> OpRegistry:
    r = OpRegistry()
    r.register("add", "naive", lambda a, b: a + b, "the definition", differentiable=True)
    r.register("add", "fast", lambda a, b: "any-device fast", "fast anywhere")
    r.register("add", "fast", lambda a, b: "cpu fast", "the CPU backend", backend="cpu")
    r.register("add", "fast", lambda a, b: "cuda fast", "a device's own", backend="cuda")
    r.register_auto("add", lambda t, _: "naive" if t.training else "fast")
    return r


def test_a_device_backend_is_preferred_and_auto_follows_the_target() -> None:
    r = toy()
    assert r.get("add", "fast", OpTarget("cpu"))(1, 2) == "cpu fast"
    assert r.get("add", "fast", OpTarget("cuda"))(1, 2) == "cuda fast"
    assert r.get("add", "fast", OpTarget("mps"))(1, 2) == "any-device fast"
    assert r.get("add", "fast", OpTarget("cpu", dtype=torch.bfloat16))(1, 2) == "any-device fast"  # the CPU forms are fp32 inference
    assert r.get("add", "auto", OpTarget("cuda", training=True))(1, 2) == 3
    assert r.names("add") == ["fast", "naive", "auto"]
    assert r.entry("add", "fast", OpTarget("cpu"))[1].backend == "cpu"


def test_the_backends_a_target_offers(monkeypatch: pytest.MonkeyPatch) -> None:
    from openk3.ops.cpu import build

    monkeypatch.setattr(build, "kernels_available", lambda: True)
    assert OpTarget().backends() == ("c", "cpu", "any")
    assert OpTarget(c_kernels=False).backends() == ("cpu", "any")
    assert OpTarget(training=True).backends() == ("any",)
    assert OpTarget(dtype=torch.bfloat16).backends() == ("c_bf16", "cpu_half", "any")
    assert OpTarget(dtype=torch.float16).backends() == ("cpu_half", "any")
    assert OpTarget(dtype=torch.float64).backends() == ("any",)
    assert OpTarget("cuda").backends() == ("cuda", "any")
    monkeypatch.setattr(build, "kernels_available", lambda: False)  # no compiler, or OPENK3_CPU_KERNELS=0
    assert OpTarget().backends() == ("cpu", "any")
    assert OpTarget(dtype=torch.bfloat16).backends() == ("cpu_half", "any")
    assert registry().entry("rms_norm", "auto")[1].backend == "any"
    assert registry().entry("linear", "auto")[1].backend == "cpu"


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
    for name in ("kda_prefill", "kda_decode", "short_conv", "mla_prefill", "mla_decode", "moe_route", "moe_experts", "attn_res", "linear", "rms_norm"):
        assert r.entry(name, "naive")[1].differentiable, name
        assert "auto" in r.names(name)


def kda_prefills(model: K3ForCausalLM) -> set[object]:
    return {m.kda_prefill for m in model.modules() if isinstance(m, KimiDeltaAttention)}


def test_the_model_chooses_by_name_for_training_and_for_serving() -> None:
    model = K3ForCausalLM(debug())
    mixed = kda_mixed_c if kernels_available() else kda_mixed  # the "c" backend's form where the kernels build
    assert kda_prefills(model) == {mixed}  # built for CPU inference
    model.select_ops(target=OpTarget(training=True))
    assert kda_prefills(model) == {kda_chunk_autograd}  # "auto" for training: the differentiable form
    model.init_weights(0)
    model.forward_tokens(torch.randint(0, 256, (1, 6))).sum().backward()  # and it differentiates
    prepare_for_serving(model, torch.device("cpu"))
    assert kda_prefills(model) == {kda_chunk_autograd}  # a module in training mode keeps what its owner chose
    prepare_for_serving(model.eval(), torch.device("cpu"))
    assert kda_prefills(model) == {mixed}  # an eval-mode one gets "auto" resolved again, for inference
    with pytest.raises(ValueError, match="'fast' is inference-only"):
        model.select_ops(OpChoice(kda="fast"), OpTarget(training=True))


def test_a_model_moved_or_put_under_autograd_after_choosing_is_told_to_choose_again() -> None:
    """Chosen once for CPU fp32 inference: a cast, or autograd, reaches an error naming select_ops, never a kernel that
    misreads the dtype or drops the gradient; selecting for what runs now works."""
    model = K3ForCausalLM(debug())
    model.init_weights(0)
    ids = torch.randint(0, 256, (1, 6))
    if "c" in OpTarget().backends():
        with pytest.raises(RuntimeError, match="chosen for CPU fp32 inference, but got .*with autograd on.*select_ops"):
            model.forward_tokens(ids)
    model.double()
    with torch.no_grad():
        if "c" in OpTarget().backends():
            with pytest.raises(RuntimeError, match="but got torch.float64 on cpu"):
                model.forward_tokens(ids)
        model.select_ops(target=OpTarget(dtype=torch.float64))
        assert model.forward_tokens(ids).dtype == torch.float64

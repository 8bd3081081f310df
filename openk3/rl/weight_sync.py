"""Weight sync: a trainer's new weights into a live single-process engine between rollouts, without rebuilding it.

The order matters, as at build time (openk3.launch.engine.build_engine):
1. the engine must be idle (LLM is synchronous: between two generate() calls nothing runs), so no answer mixes two versions;
2. each tensor is copied in place into the parameter or buffer of the same state_dict name (names, shapes and identities are
   what the serving layout keeps), so fused blocks that the parameters are views of get the new values too;
3. the serving layout is applied again (parallel/layout.py): oneDNN's packed CPU copies of the old weights are dropped now
   rather than on their next use, and whatever a copy moved out of its fused block is tied again;
4. the engine rekeys its prefix cache by the new weights' salt (LLMEngine.weights_changed) and counts a new weight version.

A partial state dict (only the tensors a trainer changed) is taken; a name the model lacks or a shape that differs is an
error before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from openk3.llm import LLM
from openk3.parallel.layout import ServingPlan, apply_serving_layout
from openk3.serve.engine import LLMEngine


def _targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_buffers()), **dict(model.named_parameters())}


def check_state_dict(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Raise a ValueError naming the first tensor the model has no place for (unknown name, other shape)."""
    targets = _targets(model)
    for name, value in state_dict.items():
        target = targets.get(name)
        if target is None:
            raise ValueError(f"update_weights: {name!r} is not a parameter or buffer of the served model")
        if tuple(value.shape) != tuple(target.shape):
            raise ValueError(f"update_weights: {name!r} has shape {tuple(value.shape)}, the served model's is {tuple(target.shape)}")


def _drop_packed_copies(model: torch.nn.Module) -> None:
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if packed is not None and hasattr(packed, "reset"):
            packed.reset()
        block = getattr(module, "block", None)
        if block is not None and hasattr(block, "packed"):
            block.packed.reset()


def update_weights(llm: LLM, state_dict: Mapping[str, torch.Tensor]) -> int:
    """Load `state_dict` into the engine behind `llm` in place (module docstring); returns the engine's new weight version."""
    engine = llm.engine
    model = engine.model
    if llm.core is not engine or not isinstance(model, torch.nn.Module):
        raise ValueError("update_weights: a single-process engine only (not ep / tp / dp > 1)")
    if engine.has_unfinished():
        raise RuntimeError("update_weights: requests are running; update between rollouts")
    check_state_dict(model, state_dict)
    targets = _targets(model)
    with torch.no_grad():
        for name, value in state_dict.items():
            targets[name].copy_(value)
    _relayout(engine, model)
    return engine.weight_version


def _relayout(engine: LLMEngine, model: torch.nn.Module) -> None:
    _drop_packed_copies(model)
    config = engine.config
    apply_serving_layout(model, ServingPlan(engine.device, ops=config.op_names, pack_cpu_weights=config.pack_cpu_weights is True))
    engine.weights_changed()

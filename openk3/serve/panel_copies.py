"""The panel copies (ops/linear.py PackedWeight.panels) that a served module's projections would read at decode sizes, for
the serving forms that chain several projections in one C call (serve/fused_moe.py, serve/fused_kda.py): each is handed
out only where the projection's own forward would take the C panel kernel, so the one call computes what the separate
calls would. Asking goes through PackedWeight, which checks the copy against the weights on every use. A module with
forward hooks (its own or global ones) gives none: the one call would skip them. What a served layer finds is kept on
it while what it depends on stays the same (`kept`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from openk3.model.layers import Linear, ProjectionGroup
from openk3.ops.linear import PackedWeight, linear_c

W = TypeVar("W")


def hooked(*modules: nn.Module) -> bool:
    """Some forward hook would run around one of `modules` (its own, or a global one) if it were called."""
    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def linear_panels(linear: Linear) -> torch.Tensor | None:
    """The panel copy a PackedLinear's forward reads, or None where its forward takes another form or has hooks."""
    packed = getattr(linear, "packed", None)
    if hooked(linear) or not isinstance(packed, PackedWeight) or linear.linear is not linear_c or linear.bias is not None or not linear.weight.is_contiguous():
        return None
    return packed.panels(linear.weight, (linear.weight,))


def group_panels(group: ProjectionGroup) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(the fused block of a FusedProjections, its panel copy) as its forward uses them, or None (not fused, not the C
    panel form, or the block released)."""
    block = getattr(group, "block", None)
    if block is None or hooked(group) or any(m.linear is not linear_c for m in group.members):
        return None
    weights = [m.weight for m in group.members]
    fused = block.rows(weights)
    if fused is None or not fused.is_contiguous():
        return None
    panels = block.packed.panels(fused, weights)
    return None if panels is None else (fused, panels)


def tensor_stamp(tensors: Sequence[torch.Tensor]) -> tuple[tuple[int, int, int], ...] | None:
    """(identity, address, version counter) of each tensor: what a value derived from them is valid for (any in-place write
    bumps the counter; `.to()`, `p.data = ...` or a new parameter changes the address or the identity); None for inference
    tensors, which have no counter (nothing derived from them may be kept)."""
    try:
        return tuple((id(t), t.data_ptr(), t._version) for t in tensors)
    except RuntimeError:
        return None


def kept(module: nn.Module, stamp: tuple | None, tensors: list[torch.Tensor], find: Callable[[], W | None]) -> W | None:
    """What `find` gives for `module` (a served layer's weights with their panel copies), found once and kept on the module
    while `stamp` (what they depend on: tensor_stamp and the modules and ops chosen) stays the same; None stamps (inference
    tensors) keep nothing. The tensors are held with it, so that no new tensor can take their addresses meanwhile."""
    held = module.__dict__.get("_held")
    if held is not None and stamp is not None and held[0] == stamp:
        return held[1]
    found = find()
    module.__dict__["_held"] = (stamp, found, tensors) if stamp is not None and found is not None else None
    return found

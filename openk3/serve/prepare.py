"""prepare_for_serving: the serving layout of a model, applied from outside it (as torchtitan's parallelize.py does), once,
by the runner -- the model classes stay plain single-device modules.

What it does: "auto" implementations resolved for inference on the device (ops/registry.py; a model in training mode keeps
its owner's choices), after the implementations the engine names (EngineConfig.ops, serve/op_names.py) are set on the
model's own OpChoice, and, by swapping the model's attach points for serving modules that hold the same parameters:
- every ProjectionGroup becomes FusedProjections: its members' weights tied into one block (serve/fused.py), one matmul
  for the group, the pieces returned as views of its output;
- every StackedWeights becomes FusedWeights: the stacked tensor is the block itself (no concatenation per call);
- on CPU with `pack_cpu_weights`: every fused block and every other bias-free Linear also keeps oneDNN's blocked copy of
  its weight, used above ops/linear.KERNEL_ROWS rows, and the C kernel's panel copy, used up to them (ops/linear.py
  PackedWeight: each made on first use at its row counts, checked against the weights on every use). One or two more
  copies of those weights: for a model only the engine writes to. Where the C kernels run, every LatentMoE also becomes a
  ServedLatentMoE (serve/fused_moe.py): at decode sizes the layer after its router is one C call over those panel copies;
  every KimiDeltaAttention a ServedKDA (serve/fused_kda.py): a decode token from the layer's input to o_proj in one; and
  every GatedMLA a ServedMLA (serve/fused_mla.py): a decode step's projections, norms and latent write in one.

Idempotent: a second call ties again whatever a `.to()`, cast_model or `p.data = ...` moved out of its block (until then
the group falls back to one matmul per member: slower, never wrong). Parameter names, identities and state_dict keys do
not change; autograd always takes the per-member path.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import cast

import torch
from torch import nn

from openk3.model.kda import KimiDeltaAttention
from openk3.model.layers import Linear, ProjectionGroup, StackedWeights
from openk3.model.mla import GatedMLA
from openk3.model.model import K3ForCausalLM
from openk3.model.moe import LatentMoE
from openk3.ops.linear import PackedWeight
from openk3.ops.registry import OpTarget
from openk3.serve.fused import FusedRows
from openk3.serve.fused_kda import ServedKDA
from openk3.serve.fused_mla import ServedMLA
from openk3.serve.fused_moe import ServedLatentMoE
from openk3.serve.op_names import select_named_ops


class FusedProjections(ProjectionGroup):
    def __init__(self, group: ProjectionGroup) -> None:
        super().__init__(group.members, group.pieces)
        self.block = FusedRows()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]  # nn.Module's own signature
        # The members are registered (and so converted) before this module: when .to() / .float() / .cuda() gave them new
        # storage, drop the old block and its packed copy now rather than keep them alive until a forward notices
        # (share_memory moves the block as a whole and keeps it). prepare_for_serving ties again.
        out = super()._apply(fn, recurse)
        if not self.block.intact(self._weights()):
            self.block.release()
        return out

    def tie(self) -> None:
        self.block.tie(self._weights())

    def _weights(self) -> list[torch.Tensor]:
        return [m.weight for m in self.members]

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights = self._weights()
        fused = self.block.rows(weights)
        if fused is None:
            return super().forward(x)
        return tuple(self.members[0].linear(x, fused, self.block.packed, weights).split(self.widths, dim=-1))


class FusedWeights(StackedWeights):
    def __init__(self, stack: StackedWeights) -> None:
        super().__init__(stack.members)
        self.block = FusedRows()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]  # as FusedProjections
        out = super()._apply(fn, recurse)
        if not self.block.intact(self.weights()):
            self.block.release()
        return out

    def tie(self) -> None:
        self.block.tie(self.weights())

    def forward(self) -> torch.Tensor:
        fused = self.block.rows(self.weights())
        return fused if fused is not None else super().forward()


class PackedLinear(Linear):
    """A bias-free Linear that also keeps oneDNN's blocked copy of its weight for CPU serving (ops/linear.py)."""

    packed: PackedWeight

    @classmethod
    def from_linear(cls, source: Linear) -> PackedLinear:
        """The same module, turned into a PackedLinear in place: its parameter, name, hooks and attributes stay, and so does
        every outside reference to it; it gains an enabled PackedWeight."""
        source.__class__ = cls
        packed = cast(PackedLinear, source)
        packed.packed = PackedWeight()
        packed.packed.enable()
        return packed

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]  # the copy of the old weight goes with it
        out = super()._apply(fn, recurse)
        self.packed.reset()
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.packed)


def _children(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Module]]:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            yield parent, name, child


def prepare_for_serving(model: nn.Module, device: torch.device, pack_cpu_weights: bool = False, ops: Mapping[str, str | int] | None = None) -> None:
    """Apply the serving layout to `model` in place (module docstring), and resolve its "auto" implementations for
    inference on `device` in the model's dtype (ops/registry.py). `ops`: implementations named for the engine
    (EngineConfig.op_names), set on the model's OpChoice first; a name that cannot run there, or a model it cannot apply
    to, is an error. `pack_cpu_weights` needs the CPU forms of "linear" (fp32 inference on CPU): asked for elsewhere, it
    is an error, not a flag quietly dropped."""
    target = OpTarget(device.type, dtype=model.lm_head.weight.dtype if isinstance(model, K3ForCausalLM) else torch.float32)
    if ops:
        select_named_ops(model, ops, target)
    elif isinstance(model, K3ForCausalLM) and not model.training:  # a module in training mode keeps the choices its owner made
        model.select_ops(target=target)
    if pack_cpu_weights and "cpu" not in target.backends():
        raise ValueError(f"pack_cpu_weights: oneDNN's packed weights are for CPU fp32 inference, not {device.type} {target.dtype} (leave it unset or off)")
    for parent, name, child in _children(model):
        if type(child) is ProjectionGroup:
            setattr(parent, name, FusedProjections(child))
        elif type(child) is StackedWeights:
            setattr(parent, name, FusedWeights(child))
    groups = [m for m in model.modules() if isinstance(m, (FusedProjections, FusedWeights))]
    for g in groups:
        g.tie()
    if not pack_cpu_weights or device.type != "cpu":
        return
    in_groups = {id(member) for g in groups for member in g.members}
    for g in groups:
        if isinstance(g, FusedProjections) and not g.block.packed.enabled:
            g.block.packed.enable()
    for child in list(model.modules()):
        if type(child) is Linear and child.bias is None and id(child) not in in_groups:
            PackedLinear.from_linear(child)
    if "c" in target.backends():
        for child in list(model.modules()):
            if type(child) is LatentMoE:
                ServedLatentMoE.from_moe(child, target)
            elif type(child) is KimiDeltaAttention:
                ServedKDA.from_layer(child, target)
            elif type(child) is GatedMLA:
                ServedMLA.from_layer(child, target)

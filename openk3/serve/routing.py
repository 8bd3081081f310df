"""Routing capture for routing replay (R3): the top-k expert ids every MoE layer chose for every token the engine ran,
recorded from outside the model and returned with the completion, so a trainer can force the same experts in its forward.

Legend: T tokens of a step (or positions of a request), L MoE layers, k experts per token.

The recorder wraps each MoE layer's expert backend (the layer's one seam, model/moe.py) in RecordingBackend, which copies
`routing.topk_idx` aside and calls the backend it wraps; the model's code is untouched. It wraps only for the forward of a
step that has a request that asked (SamplingParams.return_routing); other steps run the model as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from openk3.model.moe import ExpertBackend, LatentMoE
from openk3.ops.moe.router import RouterOutput

ROUTING_DTYPE = torch.int16  # expert ids; compact (K3's 896 experts fit), the trainer widens them to int64 to gather


@dataclass(frozen=True)
class RoutingTrace:
    """The experts chosen for positions 0 .. T-1 of one sequence (its prompt, then its generated tokens but the last, which
    the engine samples and never runs: its routing only shapes its own, unused, next-token logits)."""

    layers: tuple[int, ...]  # decoder layer index of each MoE layer: the L axis
    experts_TLk: torch.Tensor  # ROUTING_DTYPE [T, L, k]

    def layer(self, layer_index: int) -> torch.Tensor:
        """[T, k] int64: the experts of one MoE layer (by decoder layer index) for every position."""
        return self.experts_TLk[:, self.layers.index(layer_index)].long()


def moe_layers(model: torch.nn.Module) -> list[LatentMoE]:
    return sorted((m for m in model.modules() if isinstance(m, LatentMoE)), key=lambda m: m.layer_index)


class RecordingBackend:
    """An expert backend that hands the layer's routing to a recorder, then runs the backend it wraps."""

    def __init__(self, inner: ExpertBackend, recorder: RoutingRecorder) -> None:
        self.inner = inner
        self.recorder = recorder

    def __call__(self, layer: LatentMoE, z_TD: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        self.recorder.capture(layer.layer_index, routing.topk_idx)
        return self.inner(layer, z_TD, routing)


class RoutingRecorder:
    """Records one forward's routing at a time: inside `step()` each MoE layer's backend is wrapped (and given back on
    leaving), the forward runs, and `rows()` returns [T, L, k]. Wrapped only for that forward: decode graphs capture and
    select_ops rebuild the layers' own backends at other times, and never see a wrapper."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.layers = tuple(m.layer_index for m in moe_layers(model))
        self._captured: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Record the forward run inside this `with` block."""
        self._captured = {}
        layers = moe_layers(self.model)
        for moe in layers:
            moe.backend = RecordingBackend(moe.backend, self)
        try:
            yield
        finally:
            for moe in layers:
                assert isinstance(moe.backend, RecordingBackend)
                moe.backend = moe.backend.inner

    def capture(self, layer_index: int, topk_idx_Tk: torch.Tensor) -> None:
        self._captured[layer_index] = topk_idx_Tk.detach().to("cpu", ROUTING_DTYPE)

    def rows(self) -> torch.Tensor:
        """[T, L, k]: what the last recorded forward chose, every MoE layer in `layers` order."""
        missing = [i for i in self.layers if i not in self._captured]
        if missing:
            raise AssertionError(f"routing: MoE layers {missing} ran no routed experts in the recorded forward")
        return torch.stack([self._captured[i] for i in self.layers], dim=1)


class RoutingParts:
    """A request's routing as the steps computed it: (first position, [n, L, k]) pieces, a later piece over an earlier one
    (a preempted request recomputes its positions with the same tokens, so the same experts)."""

    def __init__(self) -> None:
        self.pieces: list[tuple[int, torch.Tensor]] = []

    def add(self, start: int, rows_TLk: torch.Tensor) -> None:
        self.pieces.append((start, rows_TLk))

    def trace(self, layers: tuple[int, ...], num_positions: int) -> RoutingTrace:
        if not self.pieces:
            raise AssertionError("routing: a request that asked for its routing ran no forward")
        _, first = self.pieces[0]
        out = torch.zeros(num_positions, *first.shape[1:], dtype=ROUTING_DTYPE)
        seen = torch.zeros(num_positions, dtype=torch.bool)
        for start, rows in self.pieces:
            stop = min(start + rows.shape[0], num_positions)
            out[start:stop] = rows[: stop - start]
            seen[start:stop] = True
        if not bool(seen.all()):
            raise AssertionError(f"routing: positions {(~seen).nonzero().flatten().tolist()} of {num_positions} were never run")
        return RoutingTrace(layers, out)

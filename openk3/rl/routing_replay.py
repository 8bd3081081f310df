"""Routing replay (R3) in a trainer's forward: every MoE layer takes the experts the engine chose for each token (a
RoutingTrace returned with the completion) instead of choosing its own, so the policy trained is the one that sampled.

Legend: T tokens of the forward, D hidden, E experts, k experts per token.

Only the choice is replayed: the combine weights are the trainer's own sigmoid scores at the replayed experts (renormalised
and scaled as the router does), so gradients still reach the router. Attached from outside, as the engine's recorder is: each
layer's Router keeps its routing function in `route` (the registry's "moe_route"), swapped here for the block and put back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch

from openk3.model.moe import LatentMoE
from openk3.ops.moe.router import RouterOutput
from openk3.serve.routing import RoutingTrace, moe_layers


class ReplayedRoute:
    """A "moe_route" function that returns fixed experts `idx_Tk` with the caller's weights at them."""

    def __init__(self, idx_Tk: torch.Tensor) -> None:
        self.idx_Tk = idx_Tk.long()

    def __call__(self, x_TD: torch.Tensor, weight_ED: torch.Tensor, bias_E: torch.Tensor | None, k: int, renormalize: bool, scaling: float) -> RouterOutput:
        if tuple(self.idx_Tk.shape) != (x_TD.shape[0], k):
            raise ValueError(f"routing replay: {tuple(self.idx_Tk.shape)} expert ids for {x_TD.shape[0]} tokens x k={k}")
        scores_TE = torch.sigmoid(x_TD.float() @ weight_ED.float().t())
        idx = self.idx_Tk.to(scores_TE.device)
        weight_Tk = scores_TE.gather(1, idx)
        if renormalize:
            weight_Tk = weight_Tk / (weight_Tk.sum(-1, keepdim=True) + 1e-20)  # as sigmoid_topk_route
        return RouterOutput(idx, weight_Tk * scaling, scores_TE)


def trace_rows(traces: list[RoutingTrace]) -> dict[int, torch.Tensor]:
    """The experts of sequences packed end to end (a ForwardBatch of them in this order, or one row of forward_tokens):
    MoE layer index -> [sum of T, k]."""
    layers = traces[0].layers
    if any(t.layers != layers for t in traces):
        raise ValueError("routing replay: the traces come from models with different MoE layers")
    return {layer: torch.cat([t.layer(layer) for t in traces]) for layer in layers}


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, experts: Mapping[int, torch.Tensor]) -> Iterator[None]:
    """Inside the block, each MoE layer of `model` routes token t of a forward to `experts[layer_index][t]`; one forward
    of exactly those tokens, in that order. Every MoE layer must be given."""
    layers: list[LatentMoE] = moe_layers(model)
    missing = [m.layer_index for m in layers if m.layer_index not in experts]
    if missing:
        raise ValueError(f"routing replay: no experts given for MoE layers {missing}")
    saved = [m.gate.route for m in layers]
    try:
        for m in layers:
            m.gate.route = ReplayedRoute(experts[m.layer_index])
        yield
    finally:
        for m, route in zip(layers, saved, strict=True):
            m.gate.route = route

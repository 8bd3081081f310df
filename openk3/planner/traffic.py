"""Bytes one decode step moves on the busiest rank, by flow: weights and KV/state out of HBM, and the expert
all-to-all (plus TP all-reduces and MoonEP prefetch) over the fabric, split into scale-up (inside the NVLink domain)
and scale-out (through the NIC).

These are the seed's three flows side by side. The step time (`perf.py`) is built from the same terms; this module
only counts bytes, so a reader can see why a layout is HBM- or interconnect-bound without reading times. The all-to-all
counts follow `comm.a2a_layer_time`: the busiest rank sends its own tokens' copies and receives `imbalance` times the
mean share in the dispatch, and the reverse in the combine; the share of the remote peers outside the scale-up domain
crosses the NIC (`(ep - domain) / (ep - 1)` of them under uniform routing).
"""

from __future__ import annotations

from dataclasses import dataclass

from openk3.planner.balance import moonep_prefetch_experts
from openk3.planner.comm import Exchange, combine_bytes_per_copy, copies_per_token, dispatch_bytes_per_copy, remote_domains_per_token
from openk3.planner.inputs import Balance
from openk3.planner.memory import expert_bytes, num_moe_layers
from openk3.planner.perf import Scenario, StepTime, decode_step


@dataclass(frozen=True)
class Traffic:
    """Bytes per decode step on the busiest rank. a2a_* are sent + received (both directions of its links)."""

    weights: float  # trunk and routed-expert weights streamed from HBM
    kv_state: float  # MLA latent (or GQA K/V) read, KDA state read and written, AttnRes summaries
    a2a_scale_up: float
    a2a_scale_out: float
    allreduce_scale_up: float
    allreduce_scale_out: float
    prefetch: float  # MoonEP remote-expert weights pulled
    tokens: float  # tokens this rank's group decodes per step

    @property
    def a2a(self) -> float:
        return self.a2a_scale_up + self.a2a_scale_out

    @property
    def a2a_per_token(self) -> float:
        return self.a2a / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        names = ("weights", "kv_state", "a2a_scale_up", "a2a_scale_out", "allreduce_scale_up", "allreduce_scale_out", "prefetch", "tokens")
        return {n: getattr(self, n) for n in names} | {"a2a": self.a2a, "a2a_per_token": self.a2a_per_token}


def a2a_bytes(sc: Scenario, tokens_per_rank: float, imbalance: float) -> tuple[float, float]:
    """(scale-up, scale-out) bytes sent + received by the busiest rank for one MoE layer. With the all-gather exchange
    (`Exchange.ALLGATHER`) every other rank's tokens come in and this rank's go out to each of them, in the gather and
    again in the reduce-scatter, whatever the routing (as `comm.allgather_layer_time` prices them)."""
    ranks = sc.layout.ep_size
    if ranks <= 1 or tokens_per_rank <= 0:
        return 0.0, 0.0
    domain = min(sc.system.scale_up_domain, ranks)
    per_copy = dispatch_bytes_per_copy(sc.config, sc.quant) + combine_bytes_per_copy(sc.config, sc.quant)
    if sc.comm.exchange == Exchange.ALLGATHER:
        gathered = 2 * (ranks - 1) * tokens_per_rank * per_copy  # sent and received, gather and reduce-scatter
        fraction_out = (ranks - domain) / (ranks - 1)
        return gathered * (1 - fraction_out), gathered * fraction_out
    remote, _ = copies_per_token(sc.config, ranks, sc.comm.dedup)
    both_ways = (1 + imbalance) * tokens_per_rank * per_copy  # dispatch out + in, combine back out + in, per copy
    if sc.comm.forward_by_domain and ranks > domain:  # one NIC copy per remote domain; NVLink carries every rank copy
        return both_ways * remote, both_ways * remote_domains_per_token(sc.config, ranks, domain)
    fraction_out = (ranks - domain) / (ranks - 1)
    total = both_ways * remote
    return total * (1 - fraction_out), total * fraction_out


def step_traffic(sc: Scenario, step: StepTime | None = None) -> Traffic:
    step = step or decode_step(sc)
    config, layout = sc.config, sc.layout
    by_name = {c.name: c.bytes for c in step.components}
    tokens = step.tokens_per_group
    up, out = a2a_bytes(sc, tokens / layout.tp, step.imbalance)
    layers = num_moe_layers(config)
    ar_up = ar_out = 0.0
    if layout.tp > 1:  # ring all-reduce of the residual stream, twice per layer: 2 (tp-1)/tp of the buffer each way
        ar = 2 * config.num_hidden_layers * 2 * (2 * (layout.tp - 1) / layout.tp) * tokens * config.hidden_size * 2
        ar_up, ar_out = (ar, 0.0) if layout.tp <= sc.system.scale_up_domain else (0.0, ar)
    prefetch = 0.0
    if layout.balance == Balance.MOONEP:
        assignments = tokens * layout.dp * config.moe.num_experts_per_token / layout.num_accelerators
        prefetch = layers * moonep_prefetch_experts(config, layout, assignments, sc.balance) * expert_bytes(config, sc.quant)
    kv = sum(v for k, v in by_name.items() if k not in ("trunk", "experts"))
    return Traffic(
        weights=by_name.get("trunk", 0.0) + by_name.get("experts", 0.0),
        kv_state=kv,
        a2a_scale_up=layers * up,
        a2a_scale_out=layers * out,
        allreduce_scale_up=ar_up,
        allreduce_scale_out=ar_out,
        prefetch=prefetch,
        tokens=tokens,
    )

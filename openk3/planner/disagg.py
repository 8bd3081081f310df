"""Prefill/decode disaggregation (xPyD) against aggregated serving, for one workload under one SLO.

Disaggregated: `x` prefill replicas of one layout and `y` decode replicas of another. A prefill replica packs prompts
into chunks at its prefill throughput; when a prompt is done its cache -- the MLA latent (or GQA K/V) of every prompt
token and the KDA recurrent state and conv windows (449 MB per sequence for K3, `memory.cache_spec`) -- crosses to a
decode replica. The transfer is priced after the prefill (not streamed layer by layer, so it adds to TTFT), striped
over min(prefill TP, decode TP) links; each decode TP rank needs the whole latent, so the decode group then all-gathers
it over NVLink. The link is the NIC unless the whole fleet (x and y replicas) sits inside one scale-up domain. A decode
replica decodes only: its steps carry no prefill, so the per-user speed is its own step's. TTFT = the p90 prompt's
prefill run alone (PP/CP when the search allows them) + the transfer. Replicas: x = ceil(rate x prefill busy seconds per
request), y = ceil(rate x output tokens / decode tokens/s).

Aggregated: the same request mix on one layout that time-shares prefill and decode (chunked prefill). The SLO is checked
on what a user sees: decode steps stretched by the prefill the replica also runs at the served rate
(`workload.demand`), which is why aggregated serving must keep its batch smaller than a decode pool's. Both are sized
for the same rate (the user's `--rate`, else the rate of the faster single replica of the best disaggregated pair) and
compared by fleet $ per request. Neither models queueing or the NIC contention between the transfer and the all-to-all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from openk3.planner.attention import attention_shape
from openk3.planner.hardware import System
from openk3.planner.inputs import Layout, Workload
from openk3.planner.memory import cache_spec, max_concurrency, working_set
from openk3.planner.perf import Metrics, Scenario, evaluate
from openk3.planner.pp_cp import LongPrefill, fix_ttft, with_long_prefill
from openk3.planner.request import PlanRequest
from openk3.planner.search import SLO, Candidate, batch_grid, candidate_layouts, search
from openk3.planner.workload import Demand, RequestMix, demand, mean_prefill_busy, prefill_times


@dataclass(frozen=True)
class Transfer:
    bytes: float  # one request's cache: latent/KV of its prompt + KDA state and conv windows
    lanes: int
    link: str  # "scale-up" or "scale-out"
    seconds: float


def transfer(sc: Scenario, prompt: int, prefill: Layout, decode: Layout, inside_domain: bool) -> Transfer:
    spec = cache_spec(sc.config, sc.quant)
    latent = prompt * spec.mla.bytes_per_token
    total = latent + spec.kda.bytes_per_sequence
    lanes = min(prefill.tp, decode.tp)
    sys, comm = sc.system, sc.comm
    up = sys.accelerator.scale_up_bw * comm.scale_up_efficiency
    bw = up if inside_domain else sys.scale_out_bw * comm.scale_out_efficiency
    seconds = comm.allreduce_floor_s + total / (lanes * bw)
    if attention_shape(sc.config).kv_split(decode.tp) == 1 and decode.tp > lanes:  # MLA: every decode TP rank holds the whole latent
        seconds += latent * (decode.tp - lanes) / decode.tp / up
    return Transfer(total, lanes, "scale-up" if inside_domain else "scale-out", seconds)


@dataclass(frozen=True)
class PrefillPool:
    layout: Layout
    ttft_s: float  # p90 prompt, alone, before the transfer
    busy_s: float  # replica seconds of prefill per request
    long_prefill: LongPrefill | None


@dataclass(frozen=True)
class Disaggregated:
    prefill: PrefillPool
    decode: Candidate
    x: int
    y: int
    rate: float
    transfer: Transfer
    ttft_s: float
    usd_per_request: float  # fleet $/s / rate

    @property
    def accelerators(self) -> int:
        return self.x * self.prefill.layout.num_accelerators + self.y * self.decode.layout.num_accelerators

    def describe(self) -> str:
        pre = self.prefill.layout.describe() + (f", {self.prefill.long_prefill.describe()}" if self.prefill.long_prefill else "")
        return f"{self.x}P{self.y}D: {self.x} x [{pre}] + {self.y} x [{self.decode.layout.describe()}, {self.decode.seqs_per_group} seq/group]"


@dataclass(frozen=True)
class Aggregated:
    candidate: Candidate
    demand: Demand

    @property
    def accelerators(self) -> int:
        return self.demand.accelerators or self.candidate.layout.num_accelerators

    @property
    def usd_per_request(self) -> float:
        d = self.demand
        return d.usd_per_request_fleet if d.usd_per_request_fleet is not None else d.usd_per_request


@dataclass(frozen=True)
class Comparison:
    disaggregated: Disaggregated | None
    aggregated: Aggregated | None
    rate: float | None
    winner: str  # "disaggregated", "aggregated" or "neither"
    why: str


def _usd_per_s(system: System, n: int) -> float:
    return system.price_per_hour * n / 3600


def prefill_pools(req: PlanRequest, mix: RequestMix, sc0: Scenario) -> list[PrefillPool]:
    """Every layout of the search space that holds the weights and the prompts it prefills at once."""
    out = []
    prompt = mix.ttft_prompt
    longest = max(i for i, _ in mix.pairs)
    chunk = sc0.workload.prefill_chunk
    for layout in candidate_layouts(req.config, req.system, replace(req.space, sizes=None)):
        in_flight = max(1, chunk // longest) + 1  # the packed prompts, plus a finished one waiting for its transfer
        ws = working_set(req.config, req.quant, layout, Workload(context=longest, concurrency=in_flight * layout.dp), req.system, req.fill)
        if not ws.fits:
            continue
        sc = sc0.with_(layout=layout, workload=Workload(context=prompt, concurrency=layout.dp, prompt=prompt))
        ttft = prefill_times(sc, prompt)[1]
        lp = None
        if ttft > req.slo.max_ttft_s and (req.space.max_pp > 1 or req.space.max_cp > 1):
            lp = fix_ttft(sc, req.slo.max_ttft_s, req.space.max_pp, req.space.max_cp, req.space.kda_cp)
            if lp is not None and lp.ttft_s < ttft:
                ttft = lp.ttft_s
            else:
                lp = None
        out.append(PrefillPool(layout, ttft, mean_prefill_busy(sc, mix), lp))
    return out


def _decode_pools(req: PlanRequest, mix: RequestMix) -> list[Candidate]:
    """Per layout, the highest-throughput decode batch whose own steps meet the per-user SLO."""
    slo = SLO(min_user_tok_s=req.slo.min_user_tok_s)
    space = replace(req.space, max_pp=1, max_cp=1)
    result = search(
        req.config,
        req.quant,
        req.system,
        mix.decode_context,
        slo,
        None,
        space,
        req.efficiency,
        req.comm,
        req.balance_params,
        req.fill,
        power=req.power,
        spec=req.spec,
    )
    best: dict[Layout, Candidate] = {}
    for c in result.feasible:
        if c.layout not in best or c.metrics.throughput_tok_s > best[c.layout].metrics.throughput_tok_s:
            best[c.layout] = c
    return list(best.values())


def best_disaggregated(req: PlanRequest, mix: RequestMix, sc0: Scenario) -> Disaggregated | None:
    out_tokens = mix.mean_output
    best: Disaggregated | None = None
    best_key = math.inf
    pools = prefill_pools(req, mix, sc0)
    for d in _decode_pools(req, mix):
        d_busy = out_tokens / d.metrics.throughput_tok_s
        for p in pools:
            if p.ttft_s > req.slo.max_ttft_s:
                continue
            rate = mix.rate if mix.rate is not None else max(1 / p.busy_s, 1 / d_busy)
            x, y = max(1, math.ceil(rate * p.busy_s - 1e-9)), max(1, math.ceil(rate * d_busy - 1e-9))
            n = x * p.layout.num_accelerators + y * d.layout.num_accelerators
            t = transfer(sc0, mix.ttft_prompt, p.layout, d.layout, n <= req.system.scale_up_domain)
            ttft = p.ttft_s + t.seconds
            if ttft > req.slo.max_ttft_s:
                continue
            usd = _usd_per_s(req.system, n) / rate
            # without a rate, rank at full utilisation (the busy seconds of both pools), not by this pair's rounding
            full_use = _usd_per_s(req.system, p.layout.num_accelerators) * p.busy_s + _usd_per_s(req.system, d.layout.num_accelerators) * d_busy
            key = usd if mix.rate is not None else full_use
            if key < best_key:
                best, best_key = Disaggregated(p, d, x, y, rate, t, ttft, usd), key
    return best


def best_aggregated(req: PlanRequest, mix: RequestMix, sc0: Scenario) -> Aggregated | None:
    """The cheapest aggregated replica fleet whose users see the per-user SLO with prefill interleaved."""
    best: Aggregated | None = None
    slo = req.slo
    for layout in candidate_layouts(req.config, req.system, replace(req.space, sizes=None)):
        limit = max_concurrency(req.config, req.quant, layout, mix.decode_context, req.system, req.fill) // layout.dp
        if limit < 1:
            continue

        def make(b: int, layout: Layout = layout) -> Aggregated | None:
            workload = Workload(context=mix.decode_context, concurrency=b * layout.dp, prompt=mix.ttft_prompt)
            sc = sc0.with_(layout=layout, workload=workload, efficiency=sc0.efficiency.capturing(b))  # a graph at its batch, as search
            m: Metrics = evaluate(sc)
            lp = None
            if m.ttft_s > slo.max_ttft_s and (req.space.max_pp > 1 or req.space.max_cp > 1):
                lp = fix_ttft(sc, slo.max_ttft_s, req.space.max_pp, req.space.max_cp, req.space.kda_cp)
                if lp is not None and lp.ttft_s < m.ttft_s:
                    m = with_long_prefill(m, lp)
                else:
                    lp = None
            d = demand(sc, m, mix, lp)
            ok = d.user_tok_s >= slo.min_user_tok_s and m.ttft_s <= slo.max_ttft_s
            cand = Candidate(layout, b, b * layout.dp, m, ok, "" if ok else "SLO missed with prefill interleaved", "", lp)
            return Aggregated(cand, d) if ok else None

        grid = batch_grid(limit, req.space.max_seqs_per_group)
        found = {b: make(b) for b in grid}
        ok = [b for b, a in found.items() if a is not None]
        if not ok:
            continue
        lo = max(ok)
        above = [b for b in grid if b > lo]
        hi = min(above) if above else lo + 1
        while hi - lo > 1:  # the largest batch that still meets the SLO (user speed falls as the batch grows)
            mid = (lo + hi) // 2
            a = make(mid)
            if a is not None:
                found[mid], lo = a, mid
            else:
                hi = mid
        for a in found.values():  # cheapest fleet; at equal cost the replica with the most headroom
            if a is not None and (best is None or (a.usd_per_request, -a.demand.replica_rps) < (best.usd_per_request, -best.demand.replica_rps)):
                best = a
    return best


def _why(dis: Disaggregated, agg: Aggregated, winner: str) -> str:
    a, d = agg.candidate, dis.decode
    ad = agg.demand
    parts = [
        f"aggregated decode shares each replica with prefill ({ad.prefill_share:.0%} of its busy time), stretching every decode step "
        f"x{ad.decode_stretch:.2f}, so to give users {ad.user_tok_s:.1f} tok/s it holds {a.seqs_per_group} sequences per group "
        f"and delivers {a.metrics.per_accelerator_tok_s / ad.decode_stretch:,.0f} output tok/s per accelerator",
        f"the decode pool runs {d.seqs_per_group} per group with no prefill in its steps ({d.metrics.per_accelerator_tok_s:,.0f} tok/s per "
        f"accelerator, {d.metrics.per_user_tok_s:.1f} tok/s per user)",
        f"each request's cache ({dis.transfer.bytes / 1e9:,.2f} GB: latent + KDA state) crosses over {dis.transfer.link} in "
        f"{dis.transfer.seconds * 1e3:,.1f} ms, added to TTFT ({dis.ttft_s:.2f} s vs {a.metrics.ttft_s:.2f} s aggregated)",
        f"fleet: {dis.accelerators:,} accelerators ({dis.x} prefill + {dis.y} decode replicas) vs {agg.accelerators:,} aggregated",
    ]
    cost = f"${dis.usd_per_request:.5f} vs ${agg.usd_per_request:.5f} per request"
    if winner == "disaggregated":
        lead = f"disaggregation wins ({cost}): its decode batches are not held down by interleaved prefill"
    elif math.isclose(dis.usd_per_request, agg.usd_per_request, rel_tol=1e-9):
        lead = f"a tie on cost ({cost}, the same fleet); aggregated serving takes it: one pool, no cache transfer"
    elif agg.accelerators < dis.accelerators:
        lead = f"aggregated serving wins ({cost}): the load does not fill two pools, which round up separately"
    else:
        lead = f"aggregated serving wins ({cost}): interleaving prefill costs less than the split and the transfer"
    return f"{lead}; " + "; ".join(parts)


def compare(req: PlanRequest) -> Comparison:
    """The best xPyD plan beside the best aggregated one for `req.requests` under `req.slo`."""
    mix = req.requests
    if mix is None:
        raise ValueError("disaggregation needs a workload: --input/--output or --requests (and optionally --rate)")
    sc0 = Scenario(req.config, req.quant, Layout(1), Workload(context=mix.decode_context, concurrency=1), req.system, req.efficiency, req.comm,
                   req.balance_params, req.fill, req.power, req.spec)  # fmt: skip
    dis = best_disaggregated(req, mix, sc0)
    rate = mix.rate if mix.rate is not None else (dis.rate if dis is not None else None)
    agg = best_aggregated(req, replace(mix, rate=rate), sc0) if rate is not None or dis is None else None
    if dis is None and agg is None:
        return Comparison(None, None, rate, "neither", "no disaggregated pair and no aggregated layout meets the SLO")
    if dis is None:
        return Comparison(None, agg, rate, "aggregated", "no prefill/decode pair meets the SLO (TTFT with the transfer, or per-user speed)")
    if agg is None:
        return Comparison(dis, None, rate, "disaggregated", "no aggregated layout meets the SLO once prefill interleaves with decode")
    # a tie goes to aggregated serving: one pool and no transfer for the same money
    tie = math.isclose(dis.usd_per_request, agg.usd_per_request, rel_tol=1e-9)
    winner = "disaggregated" if dis.usd_per_request < agg.usd_per_request and not tie else "aggregated"
    return Comparison(dis, agg, rate, winner, _why(dis, agg, winner))

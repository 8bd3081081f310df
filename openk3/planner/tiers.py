"""Tiered cache: when parking a sequence's cache in host DRAM or on NVMe beats keeping it in HBM or recomputing it.

A parked K3 prefix is its MLA latent (27,648 B/token) plus one KDA state snapshot (~449 MB) -- the snapshot is a fixed
cost per prefix, so short prefixes are cheaper to recompute than to reload. Reload time = bytes / tier bandwidth;
recompute time = the prefill of those tokens on one attention-DP group. Offload pays off when reload < recompute, and
it is worth doing when the sequences that must stay resumable do not fit in HBM beside the running batch.
"""

from __future__ import annotations

from dataclasses import dataclass

from openk3.planner.inputs import Workload
from openk3.planner.memory import cache_spec, working_set
from openk3.planner.perf import Scenario, prefill_step


@dataclass(frozen=True)
class TierRow:
    tier: str
    bandwidth: float  # bytes/s per accelerator
    capacity: float  # bytes per accelerator available for parked sequences
    sequences: int  # parked sequences of this prefix length that fit, per accelerator
    reload_s: float
    recompute_s: float

    @property
    def pays_off(self) -> bool:
        """The tier has room for the prefix and bringing it back is faster than recomputing it."""
        return self.sequences > 0 and self.reload_s < self.recompute_s


def parked_bytes(sc: Scenario, prefix_tokens: int) -> float:
    """One resumable prefix: latent pages plus the KDA snapshot at its end (whole, not split by TP: it is stored once)."""
    return cache_spec(sc.config, sc.quant).sequence_bytes(prefix_tokens)


def recompute_time(sc: Scenario, prefix_tokens: int) -> float:
    """Marginal prefill cost of `prefix_tokens` inside full prefill chunks: the weight reads of a step are shared with
    the other tokens of the chunk, so a short prefix pays its FLOPs, not a whole step of weight streaming. Its queries
    attend to (prefix + 1) / 2 keys on average (causal over the prefix)."""
    chunk = sc.workload.prefill_chunk
    full = Workload(context=max(prefix_tokens, chunk), concurrency=1, prompt=max(prefix_tokens, chunk), prefill_chunk=chunk)
    kv_len = max(0.0, (prefix_tokens - chunk) / 2)
    step = prefill_step(sc.with_(workload=full), kv_len=kv_len, mean_keys=(prefix_tokens + 1) / 2)
    return prefix_tokens * step.total_s / chunk


def tier_table(sc: Scenario, prefix_tokens: int) -> tuple[TierRow, ...]:
    """HBM left over beside the running batch, host DRAM, NVMe: capacity, reload time and whether reload beats recompute."""
    per_seq = parked_bytes(sc, prefix_tokens)
    mem = working_set(sc.config, sc.quant, sc.layout, sc.workload, sc.system, sc.fill)
    hbm_free = max(0.0, mem.capacity - mem.total)
    s = sc.system
    recompute = recompute_time(sc, prefix_tokens)
    rows = []
    for tier, bw, cap in (("hbm", s.accelerator.hbm_bw, hbm_free), ("host_dram", s.host_link_bw, s.host_mem_bytes), ("nvme", s.nvme_bw, s.nvme_bytes)):
        # the prefix is spread over the group's tp ranks, each moving its share over its own link
        reload = 0.0 if tier == "hbm" else per_seq / (bw * sc.layout.tp)
        rows.append(TierRow(tier, bw, cap, int(cap // per_seq), reload, recompute))
    return tuple(rows)


def break_even_tokens(sc: Scenario, tier: str, lo: int = 1, hi: int = 1 << 20) -> int | None:
    """Shortest prefix whose reload from `tier` beats recomputing it (None if none up to `hi`)."""

    def pays(n: int) -> bool:
        row = next(r for r in tier_table(sc, n) if r.tier == tier)
        return row.reload_s < row.recompute_s

    if not pays(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if pays(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo

"""Prometheus metrics with vLLM's names under an `openk3:` prefix, one CollectorRegistry per server (no module-level state).

Written from the engine thread (prometheus_client's metrics are thread-safe), read by `GET /metrics`. Gauges mirror the last
engine snapshot; counters and histograms are fed per step and per finished request by the front end.
Prefix-cache counters count prompt tokens, as vLLM does: queries += prompt tokens looked up, hits += tokens found cached.
Expert-parallel serving (rank 0 of `serve --ep N`) adds `openk3:ep_*` families through `attach_ep` (docs/ep.md, Metrics).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from openk3.serve.cache.manager import CacheManager
from openk3.serve.engine import LLMEngine
from openk3.serve.output import FinishedRequest

if TYPE_CHECKING:
    from openk3.parallel.serving.driver import EPTotals

PREFIX = "openk3:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
TIERS = ("device", "host", "disk")  # storage tiers of the prefix cache (openk3.serve.cache.tiers.TierKind values)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, label = self.registry, {"model_name": model_name}

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, doc, ("model_name", *labels), registry=r)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, ("model_name", *labels), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, ("model_name",), buckets=buckets, registry=r)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch").labels(**label)
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled").labels(**label)
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of MLA cache pages in use (1 = full)").labels(**label)
        self.kda_state_usage_perc = gauge("kda_state_usage_perc", "Fraction of KDA state slots in use (1 = full)").labels(**label)
        self.num_free_pages = gauge("cache_free_pages", "MLA cache pages free").labels(**label)
        self.num_free_slots = gauge("state_free_slots", "KDA state slots free").labels(**label)
        tier_used = gauge("cache_tier_used_bytes", "Cache bytes in use per storage tier", ("tier",))
        tier_capacity = gauge("cache_tier_capacity_bytes", "Cache bytes available per storage tier", ("tier",))
        self.tier_used = {t: tier_used.labels(tier=t, **label) for t in TIERS}
        self.tier_capacity = {t: tier_capacity.labels(tier=t, **label) for t in TIERS}
        tier_in = counter("cache_tier_bytes_in", "Bytes stored into a tier (device: snapshot and copy-on-write copies)", ("tier",))
        tier_out = counter("cache_tier_bytes_out", "Bytes loaded from a tier back to the device", ("tier",))
        tier_hits = counter("cache_tier_hits", "Prefix hits served by a tier", ("tier",))
        self.tier_counters = {
            (t, kind): family.labels(tier=t, **label) for t in TIERS for kind, family in (("in", tier_in), ("out", tier_out), ("hits", tier_hits))
        }
        self.prefix_snapshots = {
            kind: counter(f"prefix_cache_snapshots_{kind}", f"KDA state snapshots {kind}").labels(**label) for kind in ("taken", "evicted")
        }
        self.checksum_failures = counter("cache_disk_checksum_failures", "Disk-tier loads refused by their checksum").labels(**label)
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache").labels(**label)
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache").labels(**label)
        self.prompt_tokens_cached = counter("prompt_tokens_cached", "Prompt tokens served from the prefix cache").labels(**label)
        self.num_preemptions = counter("num_preemptions", "Requests preempted (cache freed, recomputed later)").labels(**label)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed").labels(**label)
        self.generation_tokens = counter("generation_tokens", "Tokens generated").labels(**label)
        self._success = counter("request_success", "Finished requests by finish reason", ("finished_reason",))
        self.model_name = model_name
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first token", TTFT_BUCKETS).labels(**label)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between consecutive tokens", ITL_BUCKETS).labels(**label)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Arrival to finish", E2E_BUCKETS).labels(**label)
        self.request_queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled", E2E_BUCKETS).labels(**label)
        self._last_totals: dict[str, int] = {"preemptions": 0, "prompt": 0, "generation": 0}
        self._ep: EPTotals | None = None

    def attach_ep(self, totals: EPTotals) -> None:
        """Also export expert-parallel stats (rank 0 of `serve --ep N`), read from `totals` at each engine snapshot."""
        r, name = self.registry, self.model_name

        def gauge(metric: str, doc: str) -> Gauge:
            return Gauge(PREFIX + metric, doc, ("model_name", "layer"), registry=r)

        def counter(metric: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + metric, doc, ("model_name", *labels), registry=r)

        self.ep_recv_max = gauge("ep_recv_tokens_max", "Last step: most routed entries one rank computed, per MoE layer")
        self.ep_recv_mean = gauge("ep_recv_tokens_mean", "Last step: mean routed entries per rank, per MoE layer")
        self.ep_maxvio = gauge("ep_maxvio", "Last step: max over experts of tokens / mean tokens, minus 1, per MoE layer")
        self.ep_recv_total = counter("ep_recv_tokens", "Routed entries computed, per rank (all MoE layers)", ("rank",))
        self.ep_bytes = counter("ep_bytes_sent", "Rank 0's dispatch, metadata and combine bytes").labels(model_name=name)
        self.ep_prefetch = counter("ep_prefetch_bytes", "Rank 0's MoonEP expert-weight prefetch bytes").labels(model_name=name)
        self.ep_spilled = counter("ep_spilled_entries", "MoonEP entries sent home for lack of a prefetch slot").labels(model_name=name)
        self._ep = totals

    def _observe_ep(self, totals: EPTotals) -> None:
        name = self.model_name
        for layer, s in totals.last.items():
            entries = s.recv_entries_R
            self.ep_recv_max.labels(model_name=name, layer=str(layer)).set(max(entries, default=0))
            self.ep_recv_mean.labels(model_name=name, layer=str(layer)).set(sum(entries) / len(entries) if entries else 0.0)
            self.ep_maxvio.labels(model_name=name, layer=str(layer)).set(s.maxvio)
        for rank, total in enumerate(totals.recv_entries_R):
            key = f"ep_recv_{rank}"
            if total > self._last_totals.get(key, 0):
                self.ep_recv_total.labels(model_name=name, rank=str(rank)).inc(total - self._last_totals.get(key, 0))
                self._last_totals[key] = total
        for counter, key, total in (
            (self.ep_bytes, "ep_bytes", totals.bytes_sent),
            (self.ep_prefetch, "ep_prefetch", totals.prefetch_bytes),
            (self.ep_spilled, "ep_spilled", totals.spilled),
        ):
            if total > self._last_totals.get(key, 0):
                counter.inc(total - self._last_totals.get(key, 0))
                self._last_totals[key] = total

    def observe_engine(self, engine: LLMEngine) -> None:
        """Mirror the engine after a step; on the engine thread (or before it starts), reading only."""
        stats, cache = engine.stats(), engine.cache
        pages, slots = cache.num_pages, cache.state_pool.num_slots
        used_pages, used_slots = pages - cache.num_free_pages, stats.state_slots_used
        page_bytes, slot_bytes = _unit_bytes(cache)
        self.num_requests_running.set(stats.num_requests_running)
        self.num_requests_waiting.set(stats.num_requests_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage_perc)
        self.kda_state_usage_perc.set(used_slots / slots if slots else 0.0)
        self.num_free_pages.set(cache.num_free_pages)
        self.num_free_slots.set(slots - used_slots)
        self.tier_used["device"].set(used_pages * page_bytes + used_slots * slot_bytes)
        self.tier_capacity["device"].set(pages * page_bytes + slots * slot_bytes)
        # the engine keeps running totals; counters advance by the difference since the last snapshot
        totals = [
            (self.num_preemptions, "preemptions", stats.num_preemptions_total),
            (self.prompt_tokens, "prompt", stats.prompt_tokens_total),
            (self.generation_tokens, "generation", stats.generation_tokens_total),
        ]
        prefix = stats.prefix_cache
        if prefix is not None:
            totals += [(self.prefix_snapshots["taken"], "snapshots_taken", prefix.snapshots_taken)]
            totals += [(self.prefix_snapshots["evicted"], "snapshots_evicted", prefix.snapshots_evicted)]
            for t in prefix.tiers:
                name = t.tier.value
                self.tier_used[name].set(t.used_bytes)
                self.tier_capacity[name].set(t.capacity_bytes)
                for kind, total in (("in", t.bytes_in), ("out", t.bytes_out), ("hits", t.hits)):
                    totals.append((self.tier_counters[(name, kind)], f"{name}_{kind}", total))
                if t.checksum_failures:
                    totals.append((self.checksum_failures, "checksum_failures", t.checksum_failures))
        for counter, name, total in totals:
            if total > self._last_totals.get(name, 0):
                counter.inc(total - self._last_totals.get(name, 0))
                self._last_totals[name] = total
        if self._ep is not None:
            self._observe_ep(self._ep)

    def observe_tokens(self, inter_token_latencies: list[float]) -> None:
        for itl in inter_token_latencies:
            self.inter_token_latency.observe(itl)

    def observe_prompt(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        self.prefix_cache_queries.inc(num_prompt_tokens)
        self.prefix_cache_hits.inc(num_cached_tokens)
        self.prompt_tokens_cached.inc(num_cached_tokens)

    def observe_finished(self, done: FinishedRequest) -> None:
        self._success.labels(model_name=self.model_name, finished_reason=done.finish_reason).inc()
        for value, hist in (
            (done.time_to_first_token, self.time_to_first_token),
            (done.e2e_latency, self.e2e_request_latency),
            (done.queue_time, self.request_queue_time),
        ):
            if value is not None:
                hist.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _unit_bytes(cache: CacheManager) -> tuple[int, int]:
    """Bytes of one MLA page (all MLA layers) and of one KDA state slot (recurrent state + conv window, all KDA layers)."""
    t = cache.tensors
    page = sum(x.nbytes for x in t.mla_latent) // max(cache.num_pages, 1)
    slot = (sum(x.nbytes for x in t.kda_state) + sum(x.nbytes for x in t.conv_state)) // max(cache.state_pool.num_slots, 1)
    return page, slot

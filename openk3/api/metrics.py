"""Prometheus metrics with vLLM's names under a prefix (`openk3:` by default; `serve --metrics-prefix vllm:` gives vLLM's
own names, so stock vLLM dashboards and alerts read openk3 unchanged), one CollectorRegistry per server (no module-level
state), with vLLM's `model_name` label. vLLM's older names that its example Grafana dashboard still reads are kept beside
the newer ones: `gpu_cache_usage_perc` (= kv_cache_usage_perc), `cpu_cache_usage_perc` (the host tier's bytes in use) and
`time_per_output_token_seconds` (= inter_token_latency_seconds, one sample per token gap); the per-request TPOT is
`request_time_per_output_token_seconds`, as in vLLM v1. HTTP request metrics (api/http_metrics.py) share the registry.

Written from the engine thread (prometheus_client's metrics are thread-safe), read by `GET /metrics`. Gauges mirror the last
engine snapshot; counters and histograms are fed per step and per finished request by the front end.
Prefix-cache counters count prompt tokens, as vLLM does: queries += prompt tokens looked up, hits += tokens found cached.
Expert-parallel serving (rank 0 of `serve --ep N` or `serve --dp D`) adds `openk3:ep_*` families through `attach_ep`
(docs/parallel.md, Metrics).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from openk3.api.spec_metrics import SpecDecodeMetrics
from openk3.serve.cache.manager import CacheManager
from openk3.serve.cache.tier_types import TierKind
from openk3.serve.engine_api import ServedEngine
from openk3.serve.output import FinishedRequest

if TYPE_CHECKING:
    from openk3.parallel.serving.driver import EPTotals

PREFIX = "openk3:"
CONTENT_TYPE = CONTENT_TYPE_LATEST
CACHE_INFO = (
    "page_size",
    "num_pages",
    "num_state_slots",
    "cache_memory_bytes",
    "cache_dtype",
    "enable_prefix_caching",
    "prefix_match_unit",
    "cpu_offload_bytes",
    "disk_offload_bytes",
)  # cache_config_info's labels
TIERS = tuple(k.value for k in TierKind)  # the prefix cache's tiers and its transfer inbox: every `tier` label

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(7) for m in (1, 2, 5)) + (1e7,)  # vLLM's 1-2-5 series, to 10M tokens
ITERATION_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0, 32768.0)


PREFIX_PATTERN = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)?$")


def check_prefix(prefix: str) -> str:
    """A metric-name prefix Prometheus accepts (letters, digits, `_` and `:`; not starting with a digit), or a ValueError."""
    if not PREFIX_PATTERN.match(prefix):
        raise ValueError(f"--metrics-prefix {prefix!r}: a Prometheus name prefix is letters, digits, '_' and ':' (not starting with a digit), e.g. vllm:")
    return prefix


class ServerMetrics:
    def __init__(self, model_name: str, prefix: str = PREFIX) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.prefix = prefix = check_prefix(prefix)
        r, label = self.registry, {"model_name": model_name}

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(prefix + name, doc, ("model_name", *labels), registry=r)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(prefix + name, doc, ("model_name", *labels), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(prefix + name, doc, ("model_name",), buckets=buckets, registry=r)

        # the process's own (process_resident_memory_bytes, process_cpu_seconds_total, process_open_fds, python_info), as
        # the default registry has them; ProcessCollector reads /proc and exports nothing where there is none. No
        # GCCollector: each one adds a gc callback for the life of the interpreter, one per server built.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch").labels(**label)
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled").labels(**label)
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of MLA cache pages in use (1 = full)").labels(**label)
        self.gpu_cache_usage_perc = gauge("gpu_cache_usage_perc", "vLLM's older name of kv_cache_usage_perc").labels(**label)
        self.cpu_cache_usage_perc = gauge("cpu_cache_usage_perc", "Fraction of the host (CPU) cache tier's bytes in use (0 without one)").labels(**label)
        self.kda_state_usage_perc = gauge("kda_state_usage_perc", "Fraction of KDA state slots in use (1 = full)").labels(**label)
        self.num_free_pages = gauge("cache_free_pages", "MLA cache pages free").labels(**label)
        self.num_free_slots = gauge("state_free_slots", "KDA state slots free").labels(**label)
        tier_used = gauge("cache_tier_used_bytes", "Cache bytes in use per storage tier", ("tier",))
        tier_capacity = gauge("cache_tier_capacity_bytes", "Cache bytes available per storage tier", ("tier",))
        self.tier_used = {t: tier_used.labels(tier=t, **label) for t in TIERS}
        self.tier_capacity = {t: tier_capacity.labels(tier=t, **label) for t in TIERS}
        tier_entries = gauge("cache_tier_entries", "Prefix boundaries held per storage tier (inbox: imported records waiting)", ("tier",))
        self.tier_entries = {t: tier_entries.labels(tier=t, **label) for t in TIERS}
        tier_in = counter("cache_tier_bytes_in", "Bytes stored into a tier (device: snapshot and copy-on-write copies)", ("tier",))
        tier_out = counter("cache_tier_bytes_out", "Bytes loaded from a tier back to the device", ("tier",))
        tier_hits = counter("cache_tier_hits", "Prefix hits served by a tier", ("tier",))
        self.tier_counters = {
            (t, kind): family.labels(tier=t, **label) for t in TIERS for kind, family in (("in", tier_in), ("out", tier_out), ("hits", tier_hits))
        }
        self.prefix_snapshots = {
            kind: counter(f"prefix_cache_snapshots_{kind}", f"KDA state snapshots {kind}").labels(**label) for kind in ("taken", "evicted")
        }
        self.shared_prefill_waits = counter(
            "prefix_cache_shared_prefill_waits", "Times a request waited a step for a running prefill of a prefix it shares"
        ).labels(**label)
        self.remote = {
            name: counter(f"prefix_cache_remote_{name}", doc).labels(**label)
            for name, doc in (
                ("pulls", "Prefixes imported from another replica instead of computed (cross-replica prefix pull)"),
                ("pull_bytes", "Bytes of the prefix records imported from other replicas"),
                ("pull_failures", "Prefix pulls that brought nothing (refused, evicted on the holder, or no answer): the prompt was computed"),
                ("exports", "Prefixes exported to another replica"),
            )
        }
        self.checksum_failures = counter("cache_disk_checksum_failures", "Disk-tier loads refused by their checksum").labels(**label)
        self.write_failures = counter("cache_disk_write_failures", "Disk-tier files that could not be written (the entries were let go)").labels(**label)
        self.inbox_dropped = counter("cache_inbox_dropped", "Imported prefix records let go unused (aged out or refused at lookup)").labels(**label)
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
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "Per request: decode time / (generated tokens - 1)", ITL_BUCKETS
        ).labels(**label)
        self.token_gaps = histogram("time_per_output_token_seconds", "vLLM's older name of inter_token_latency_seconds", ITL_BUCKETS).labels(**label)
        self.request_prefill_time = histogram("request_prefill_time_seconds", "First scheduled to first token", E2E_BUCKETS).labels(**label)
        self.request_decode_time = histogram("request_decode_time_seconds", "First token to last token", E2E_BUCKETS).labels(**label)
        self.request_inference_time = histogram("request_inference_time_seconds", "First scheduled to last token", E2E_BUCKETS).labels(**label)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens per prompt, when its prefill ends", TOKEN_BUCKETS).labels(**label)
        self.request_generation_tokens = histogram("request_generation_tokens", "Tokens generated per request (sample)", TOKEN_BUCKETS).labels(**label)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Per engine step that sampled tokens: tokens sampled + prompt tokens of prefills it ended", ITERATION_BUCKETS
        ).labels(**label)
        self.cache_config_info = Gauge(prefix + "cache_config_info", "The cache's configuration (labels; value 1)", ("model_name", *CACHE_INFO), registry=r)
        self._prefix_caching = False  # learnt from the engine's first snapshot, before any prompt is observed
        self._described = False
        self._iteration_prompt_tokens = 0
        self._last_totals: dict[str, int] = {"preemptions": 0, "prompt": 0, "generation": 0}
        self._ep: EPTotals | None = None
        self._spec: SpecDecodeMetrics | None = None  # made on the first snapshot with speculative decoding (api/spec_metrics.py)

    def attach_ep(self, totals: EPTotals) -> None:
        """Also export expert-parallel stats (rank 0 of `serve --ep N` or `--dp D`), read from `totals` at each engine snapshot."""
        r, name, prefix = self.registry, self.model_name, self.prefix

        def gauge(metric: str, doc: str) -> Gauge:
            return Gauge(prefix + metric, doc, ("model_name", "layer"), registry=r)

        def counter(metric: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(prefix + metric, doc, ("model_name", *labels), registry=r)

        self.ep_recv_max = gauge("ep_recv_tokens_max", "Last step: most routed entries one rank computed, per MoE layer")
        self.ep_recv_mean = gauge("ep_recv_tokens_mean", "Last step: mean routed entries per rank, per MoE layer")
        self.ep_maxvio = gauge("ep_maxvio", "Last step: max over experts of tokens / mean tokens, minus 1, per MoE layer")
        self.ep_recv_total = counter("ep_recv_tokens", "Routed entries computed, per rank (all MoE layers)", ("rank",))
        self.ep_bytes = counter("ep_bytes_sent", "Rank 0's dispatch, metadata and combine bytes").labels(model_name=name)
        self.ep_prefetch = counter("ep_prefetch_bytes", "Rank 0's MoonEP expert-weight prefetch bytes").labels(model_name=name)
        self.ep_spilled = counter("ep_spilled_entries", "MoonEP entries sent home for lack of a prefetch slot").labels(model_name=name)
        self.ep_dummy = counter(
            "ep_dummy_forwards", "Data-parallel ranks' one-token forwards run for want of work (their entries are in ep_recv_tokens)"
        ).labels(model_name=name)
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
            (self.ep_dummy, "ep_dummy", totals.dummy_forwards),
        ):
            if total > self._last_totals.get(key, 0):
                counter.inc(total - self._last_totals.get(key, 0))
                self._last_totals[key] = total

    def observe_engine(self, engine: ServedEngine) -> None:
        """Mirror the engine after each iteration of the engine loop (a step or not); on the engine thread (or before it
        starts), reading only."""
        stats, cache = engine.stats(), engine.cache
        if not self._described:
            self._describe(engine)
        generated = stats.generation_tokens_total - self._last_totals["generation"]
        if generated or self._iteration_prompt_tokens:
            self.iteration_tokens.observe(generated + self._iteration_prompt_tokens)
        self._iteration_prompt_tokens = 0
        # pool sizes and use from stats (with data-parallel attention: every rank's); bytes per unit from the cache's layout
        pages, slots = stats.num_pages, stats.num_state_slots
        used_pages, used_slots = pages - stats.num_free_pages, stats.state_slots_used
        page_bytes, slot_bytes = _unit_bytes(cache)
        self.num_requests_running.set(stats.num_requests_running)
        self.num_requests_waiting.set(stats.num_requests_waiting)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage_perc)
        self.gpu_cache_usage_perc.set(stats.kv_cache_usage_perc)
        self.kda_state_usage_perc.set(used_slots / slots if slots else 0.0)
        self.num_free_pages.set(stats.num_free_pages)
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
            totals += [(self.shared_prefill_waits, "shared_prefill_waits", prefix.shared_prefill_waits)]
            totals += [(self.remote[name], f"remote_{name}", getattr(prefix, f"remote_{name}")) for name in self.remote]
            for t in prefix.all_tiers:
                name = t.tier.value
                self.tier_used[name].set(t.used_bytes)
                self.tier_capacity[name].set(t.capacity_bytes)
                self.tier_entries[name].set(t.entries)
                if t.tier is TierKind.HOST:
                    self.cpu_cache_usage_perc.set(t.used_bytes / t.capacity_bytes if t.capacity_bytes else 0.0)
                for kind, total in (("in", t.bytes_in), ("out", t.bytes_out), ("hits", t.hits)):
                    totals.append((self.tier_counters[(name, kind)], f"{name}_{kind}", total))
                if t.checksum_failures:
                    totals.append((self.checksum_failures, "checksum_failures", t.checksum_failures))
                if t.write_failures:
                    totals.append((self.write_failures, "write_failures", t.write_failures))
                if t.tier is TierKind.INBOX and t.dropped:
                    totals.append((self.inbox_dropped, "inbox_dropped", t.dropped))
        for counter, name, total in totals:
            if total > self._last_totals.get(name, 0):
                counter.inc(total - self._last_totals.get(name, 0))
                self._last_totals[name] = total
        if stats.spec_decode is not None:
            if self._spec is None:
                self._spec = SpecDecodeMetrics(self.registry, self.prefix, self.model_name)
            self._spec.observe(stats.spec_decode)
        if self._ep is not None:
            self._observe_ep(self._ep)

    def observe_tokens(self, inter_token_latencies: list[float]) -> None:
        for itl in inter_token_latencies:
            self.inter_token_latency.observe(itl)
            self.token_gaps.observe(itl)

    def observe_prompt(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """A prompt whose prefill has ended (its first token is out)."""
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self._iteration_prompt_tokens += num_prompt_tokens
        if self._prefix_caching:  # with caching off nothing is looked up (vLLM keeps these at 0 too)
            self.prefix_cache_queries.inc(num_prompt_tokens)
            self.prefix_cache_hits.inc(num_cached_tokens)
        self.prompt_tokens_cached.inc(num_cached_tokens)

    def observe_first_tokens(self, first_token_latencies: list[float]) -> None:
        """Samples whose first token left in the last step (an abort after it does not take it back)."""
        for ttft in first_token_latencies:
            self.time_to_first_token.observe(ttft)

    def observe_finished(self, done: FinishedRequest) -> None:
        """A sample that ended."""
        self._success.labels(model_name=self.model_name, finished_reason=done.finish_reason).inc()
        self.request_generation_tokens.observe(done.num_generation_tokens)
        for value, hist in (
            (done.e2e_latency, self.e2e_request_latency),
            (done.queue_time, self.request_queue_time),
            (done.prefill_time, self.request_prefill_time),
            (done.decode_time, self.request_decode_time),
            (done.inference_time, self.request_inference_time),
            (done.time_per_output_token, self.time_per_output_token),
        ):
            if value is not None:
                hist.observe(value)

    def _describe(self, engine: ServedEngine) -> None:
        c, cache = engine.config, engine.cache
        self._prefix_caching = c.enable_prefix_caching
        tensors = [*cache.tensors.mla_latent, *cache.tensors.kda_state]
        values = {
            "page_size": cache.page_size,
            "num_pages": cache.num_pages,
            "num_state_slots": cache.state_pool.num_slots,
            "cache_memory_bytes": c.cache_memory_bytes,
            "cache_dtype": str(tensors[0].dtype).removeprefix("torch.") if tensors else "",
            "enable_prefix_caching": c.enable_prefix_caching,
            "prefix_match_unit": c.prefix_match_unit,
            "cpu_offload_bytes": c.cpu_offload_bytes,
            "disk_offload_bytes": c.disk_offload_bytes,
        }
        self.cache_config_info.labels(model_name=self.model_name, **{k: str(v) for k, v in values.items()}).set(1)
        self._described = True

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _unit_bytes(cache: CacheManager) -> tuple[int, int]:
    """Bytes of one MLA page (all MLA layers) and of one KDA state slot (recurrent state + conv window, all KDA layers)."""
    t = cache.tensors
    page = sum(x.nbytes for x in t.mla_latent) // max(cache.num_pages, 1)
    slot = (sum(x.nbytes for x in t.kda_state) + sum(x.nbytes for x in t.conv_state)) // max(cache.state_pool.num_slots, 1)
    return page, slot

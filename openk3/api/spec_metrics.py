"""vLLM's speculative-decoding counters on /metrics (`<prefix>spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos{position}`), advanced from the engine's running totals
(serve/speculative.py SpecDecodeStats) by their difference since the last snapshot. Registered on the first snapshot that
has them, so an engine without a draft model exports none, as vLLM does."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from openk3.serve.speculative import SpecDecodeStats


class SpecDecodeMetrics:
    def __init__(self, registry: CollectorRegistry, prefix: str, model_name: str) -> None:
        label = {"model_name": model_name}

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(prefix + name, doc, ("model_name", *labels), registry=registry)

        self.drafts = counter("spec_decode_num_drafts", "Verifications run (one per speculating request and step)").labels(**label)
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed").labels(**label)
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted").labels(**label)
        self._per_pos = counter("spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted at each draft position", ("position",))
        self._label = label
        self._last = SpecDecodeStats()

    def observe(self, stats: SpecDecodeStats) -> None:
        last = self._last
        self.drafts.inc(stats.num_drafts - last.num_drafts)
        self.draft_tokens.inc(stats.num_draft_tokens - last.num_draft_tokens)
        self.accepted.inc(stats.num_accepted_tokens - last.num_accepted_tokens)
        for pos, total in enumerate(stats.accepted_per_position):
            before = last.accepted_per_position[pos] if pos < len(last.accepted_per_position) else 0
            self._per_pos.labels(position=str(pos), **self._label).inc(total - before)
        self._last = SpecDecodeStats(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens, list(stats.accepted_per_position))

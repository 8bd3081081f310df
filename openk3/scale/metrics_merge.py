"""The front end's /metrics: every replica's own metrics under a `replica` label, plus the front end's routing counters.

Each replica's text is parsed and its samples re-labelled; a family is written once with the samples of all replicas (the
text format wants a family's samples together), so Prometheus sees e.g. `openk3:num_requests_running{replica="ab12",...}`
per replica and sums them itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def merged_families(texts: Mapping[str, str]) -> list[Metric]:
    """One family per metric name over all replicas' texts, each sample labelled with its replica."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                merged.samples.append(Sample(s.name, {"replica": replica, **s.labels}, s.value, s.timestamp, s.exemplar))
    return list(families.values())


class _Families:
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def render(families: Iterable[Metric]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))  # type: ignore[arg-type]
    return generate_latest(registry)


def gauge(name: str, documentation: str, values: Mapping[tuple[tuple[str, str], ...], float]) -> Metric:
    family = Metric(name, documentation, "gauge")
    for labels, value in values.items():
        family.add_sample(name, dict(labels), value)
    return family


def counter(name: str, documentation: str, value: float) -> Metric:
    family = Metric(name, documentation, "counter")
    family.add_sample(name + "_total", {}, value)
    return family

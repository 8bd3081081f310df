"""The transfer inbox (serve/cache/inbox.py) reaches /metrics as tier="inbox": a record imported through
LLMEngine.import_prefix on a running server moves the inbox's used bytes, entries and bytes in; the request that hits it
moves bytes out and hits and empties it; records aged out unused count as dropped. Records are made as in
tests/serve/test_disaggregation.py: a prefill engine runs P[:-1] and exports the snapshot at len(P) - 1."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from openk3.api.metrics import TIERS
from openk3.serve.cache import tier_record
from openk3.serve.cache.tier_types import TierKind
from openk3.serve.sampling import SamplingParams
from tests.api.conftest import LiveServer, debug_engine, start_server, stop_server

CACHED: dict[str, Any] = dict(enable_prefix_caching=True, num_snapshot_slots=4)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


PROMPTS = (prompt(40, 0), prompt(33, 1), prompt(27, 2))


@pytest.fixture(scope="module")
def records(torch_one_thread) -> list[bytes]:
    engine = debug_engine(**CACHED)  # same preset and seed as the server's: the same salt, so its records match there
    out = []
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p[:-1], SamplingParams(temperature=0, max_tokens=1))
        while engine.has_unfinished():
            engine.step()
        record = engine.export_prefix(p[:-1])
        assert record is not None
        out.append(record)
    engine.close()
    return out


@pytest.fixture(scope="module")
def live(torch_one_thread) -> Iterator[LiveServer]:
    server = start_server(**CACHED)
    yield server
    stop_server(server)


def inbox(text: str, name: str) -> float:
    labels = r'\{[^}]*tier="inbox"[^}]*\}' if name.startswith("cache_tier_") else r"\{[^}]*\}"
    match = re.search(rf"^openk3:{name}{labels} (\S+)$", text, re.M)
    assert match, name
    return float(match.group(1))


def settled(live: LiveServer, http: httpx.Client, expected: dict[str, float]) -> str:
    """/metrics once the engine thread has published everything done before this call, with every `expected` inbox
    sample at its value. The engine loop publishes at the end of each iteration and runs a call at the start of one, so
    a no-op call returns only after every earlier iteration has published: an ordering, not a wait."""
    live.in_loop(live.frontend.call(lambda engine: None))
    text = http.get("/metrics").text
    assert {name: inbox(text, name) for name in expected} == expected
    return text


def test_the_tier_labels_are_every_tier_kind() -> None:
    assert TIERS == tuple(k.value for k in TierKind) and "inbox" in TIERS


def test_an_imported_record_moves_the_inbox_metrics_and_its_hit_moves_them_back(live: LiveServer, http: httpx.Client, records) -> None:
    nbytes = tier_record.decode(records[0]).nbytes
    text = settled(live, http, {"cache_tier_used_bytes": 0, "cache_tier_entries": 0, "cache_tier_bytes_in_total": 0, "cache_tier_hits_total": 0})
    assert inbox(text, "cache_tier_capacity_bytes") >= nbytes  # the inbox's budget: the device cache's size
    assert live.in_loop(live.frontend.call(lambda e: e.import_prefix(records[0]))) == len(PROMPTS[0]) - 1
    settled(live, http, {"cache_tier_used_bytes": nbytes, "cache_tier_entries": 1, "cache_tier_bytes_in_total": nbytes, "cache_tier_bytes_out_total": 0})
    r = http.post("/v1/completions", json={"model": "debug", "prompt": PROMPTS[0], "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPTS[0]) - 1  # served from the hand-off
    settled(live, http, {"cache_tier_used_bytes": 0, "cache_tier_entries": 0, "cache_tier_bytes_out_total": nbytes, "cache_tier_hits_total": 1})
    live.in_loop(live.frontend.call(lambda e: e.check_integrity()))


def test_records_aged_out_unused_count_as_dropped(live: LiveServer, http: httpx.Client, records) -> None:
    sizes = [tier_record.decode(r).nbytes for r in records[1:]]
    before = inbox(http.get("/metrics").text, "cache_inbox_dropped_total")

    def import_two(engine) -> None:
        assert engine.cache.inbox is not None
        engine.cache.inbox.capacity_bytes = max(sizes)  # room for one of them: the second import ages the first out
        for record in records[1:]:
            engine.import_prefix(record)

    live.in_loop(live.frontend.call(import_two))
    settled(live, http, {"cache_inbox_dropped_total": before + 1, "cache_tier_entries": 1, "cache_tier_used_bytes": sizes[1]})

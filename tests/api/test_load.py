"""Load on loopback: 64 concurrent streaming clients, a quarter of them disconnecting mid-stream, then the fuzzed schema.

Afterwards no 5xx was seen, every request completed or was aborted, and every page and state slot is free again (through
/metrics and the engine's check_integrity()).
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

from tests.api.conftest import MAX_NUM_SEQS, NUM_PAGES, metric

NUM_CLIENTS = 64
MAX_TOKENS = 24


async def stream_one(client: httpx.AsyncClient, i: int, disconnect: bool) -> tuple[str, int]:
    body = {
        "model": "debug",
        "prompt": f"client {i} says" + " hi" * (i % 7),
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return f"status {r.status_code}", 0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return "done", chunks
            obj = json.loads(line[6:])
            if "error" in obj:
                return f"error {obj['error']}", chunks
            if obj["choices"]:
                chunks += 1
            elif obj.get("usage"):
                assert obj["usage"]["completion_tokens"] == MAX_TOKENS
            if disconnect and chunks == 2:
                return "disconnected", chunks  # leaving the context manager closes the connection mid-stream
    return "no [DONE]", chunks


def test_concurrent_streams_with_disconnects_leave_nothing_behind(live) -> None:
    async def main() -> list[tuple[str, int]]:
        limits = httpx.Limits(max_connections=NUM_CLIENTS)
        async with httpx.AsyncClient(base_url=live.base_url, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(stream_one(client, i, disconnect=i % 4 == 0) for i in range(NUM_CLIENTS)))

    before = httpx.get(live.base_url + "/metrics").text
    outcomes = asyncio.run(main())
    assert sorted({o for o, _ in outcomes}) == ["disconnected", "done"], outcomes
    assert sum(o == "disconnected" for o, _ in outcomes) == NUM_CLIENTS // 4
    live.check_idle_and_free()
    text = httpx.get(live.base_url + "/metrics").text
    assert metric(text, "num_requests_running") == 0 and metric(text, "num_requests_waiting") == 0
    assert metric(text, "kv_cache_usage_perc") == 0 and metric(text, "kda_state_usage_perc") == 0
    assert metric(text, "cache_free_pages") == NUM_PAGES and metric(text, "state_free_slots") == MAX_NUM_SEQS
    assert metric(text, "cache_tier_used_bytes") == 0
    finished = re.findall(r'^openk3:request_success_total\{finished_reason="(\w+)",model_name="debug"\} (\S+)$', text, re.M)
    counts = {reason: float(v) for reason, v in finished}
    old = dict(re.findall(r'^openk3:request_success_total\{finished_reason="(\w+)",model_name="debug"\} (\S+)$', before, re.M))
    new_length = counts.get("length", 0) - float(old.get("length", 0))
    new_abort = counts.get("abort", 0) - float(old.get("abort", 0))
    assert new_length == NUM_CLIENTS - NUM_CLIENTS // 4
    assert new_abort == NUM_CLIENTS // 4  # a disconnected client's request is aborted, not run to the end
    assert metric(text, "time_to_first_token_seconds_count") >= NUM_CLIENTS - NUM_CLIENTS // 4
    assert httpx.get(live.base_url + "/health").status_code == 200


def aborted(live) -> float:
    text = httpx.get(live.base_url + "/metrics").text
    match = re.search(r'^openk3:request_success_total\{finished_reason="abort",model_name="debug"\} (\S+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


def test_non_streaming_disconnect_aborts(live) -> None:
    async def main() -> None:
        async with httpx.AsyncClient(base_url=live.base_url, timeout=0.3) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json={"model": "debug", "prompt": "slow", "max_tokens": 230, "ignore_eos": True})

    before = aborted(live)
    asyncio.run(main())
    live.check_idle_and_free()
    assert aborted(live) == before + 1


def test_preemption_under_a_small_cache_is_counted_and_cleaned(torch_one_thread) -> None:
    from tests.api.conftest import start_server, stop_server

    small = start_server(num_pages=12, max_num_seqs=8, max_model_len=64)  # 96 tokens of MLA cache for 8 requests of up to 60 tokens: preemption

    async def main() -> list[int]:
        async with httpx.AsyncClient(base_url=small.base_url, timeout=60) as client:
            body = {"model": "debug", "prompt": "p" * 20, "max_tokens": 40, "ignore_eos": True, "temperature": 0}
            rs = await asyncio.gather(*(client.post("/v1/completions", json=body) for _ in range(8)))
            assert all(r.status_code == 200 for r in rs)
            assert len({r.json()["choices"][0]["text"] for r in rs}) == 1  # greedy: preemption and recompute change nothing
            return [r.json()["usage"]["completion_tokens"] for r in rs]

    try:
        assert asyncio.run(main()) == [40] * 8
        text = httpx.get(small.base_url + "/metrics").text
        assert metric(text, "num_preemptions_total") > 0
        assert metric(text, "cache_free_pages") == 12 and metric(text, "kv_cache_usage_perc") == 0
        small.in_loop(small.frontend.call(lambda e: e.check_integrity()))
    finally:
        stop_server(small)

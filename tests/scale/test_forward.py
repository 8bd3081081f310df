"""The failure rule with fake replicas and injected faults (no Ray, no clock): lost before any byte -> retried once, on
another replica; lost twice -> 503 naming the cause; lost mid-stream -> an SSE error event with code 503, then [DONE]."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from openk3.api.errors import APIError
from openk3.scale.calls import ReplicaCall, ResponseHead
from openk3.scale.forward import ForwardStats, rest_of_body, start


class Lost(Exception):
    pass


SSE = ((b"content-type", b"text/event-stream"),)


class FakeReplicas:
    """Each call takes the next script: the replica it lands on and how many items it yields before it is lost (None: never)."""

    def __init__(self, scripts: list[tuple[str, int | None]]) -> None:
        self.scripts = scripts
        self.calls: list[ReplicaCall] = []

    async def open(self, call: ReplicaCall) -> AsyncIterator[ResponseHead | bytes]:
        self.calls.append(call)
        replica, lost_after = self.scripts.pop(0)
        items: list[ResponseHead | bytes] = [ResponseHead(200, SSE, replica), b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
        for i, item in enumerate(items):
            if lost_after is not None and i == lost_after:
                raise Lost(f"replica {replica} died")
            yield item


async def answer(fake: FakeReplicas, stats: ForwardStats) -> bytes:
    started = await start(fake.open, ReplicaCall("POST", "/v1/completions"), (Lost,), stats)
    return b"".join([chunk async for chunk in rest_of_body(started, (Lost,), stats)])


def test_a_replica_lost_before_its_first_chunk_is_retried_once_elsewhere() -> None:
    fake, stats = FakeReplicas([("a", 1), ("b", None)]), ForwardStats()
    body = asyncio.run(answer(fake, stats))
    assert body == b"data: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
    assert stats.retries == 1 and [c.avoid for c in fake.calls] == [frozenset(), frozenset({"a"})]


def test_lost_twice_is_a_503() -> None:
    fake, stats = FakeReplicas([("a", 0), ("b", 1)]), ForwardStats()
    with pytest.raises(APIError) as err:
        asyncio.run(answer(fake, stats))
    assert err.value.status == 503 and "lost before answering, twice (Lost)" in err.value.message
    assert err.value.body()["error"]["code"] == "replica_unavailable"
    assert stats.retries == 1 and stats.failed_before_send == 1


def test_lost_mid_stream_ends_the_stream_with_a_503_event() -> None:
    fake, stats = FakeReplicas([("a", 2)]), ForwardStats()
    body = asyncio.run(answer(fake, stats)).decode()
    events = [e.removeprefix("data: ") for e in body.strip().split("\n\n")]
    assert events[0] == "1" and events[-1] == "[DONE]"
    error = json.loads(events[1])["error"]
    assert error["code"] == "replica_unavailable" and "replica a was lost mid-stream" in error["message"]
    assert stats.retries == 0 and stats.failed_mid_stream == 1

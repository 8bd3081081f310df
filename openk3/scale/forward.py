"""The failure rule of the front end: a replica lost before any byte of the answer was sent is retried once elsewhere;
lost after, the client gets a clear 503 -- as the status when nothing was sent, in the stream when a stream had started.

`open_call(call)` starts a call on some replica and returns its async iterator of ResponseHead then body chunks; `lost`
are the exceptions that mean "that replica is gone" (Ray's RayActorError in production, a fake's in tests). The head is
held back until the first body chunk: a replica dying between its head and its first chunk has sent the client nothing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from openk3.api.errors import APIError
from openk3.scale.calls import ReplicaCall, ResponseHead

OpenCall = Callable[[ReplicaCall], AsyncIterator[ResponseHead | bytes]]

REPLICA_HEADER = b"x-openk3-replica"


@dataclass
class ForwardStats:
    retries: int = 0  # calls retried because their replica was lost before sending anything
    failed_before_send: int = 0  # lost twice: answered 503
    failed_mid_stream: int = 0  # lost after bytes were sent: ended with an in-stream 503


def unavailable(message: str) -> APIError:
    return APIError(503, message, code="replica_unavailable", type="ServiceUnavailableError", headers={"Retry-After": "1"})


@dataclass(frozen=True)
class Started:
    """A call whose replica has sent its head and first chunk: the answer can begin."""

    head: ResponseHead
    first: bytes | None  # None: the body was empty
    rest: AsyncIterator[ResponseHead | bytes]


async def start(open_call: OpenCall, call: ReplicaCall, lost: tuple[type[BaseException], ...], stats: ForwardStats) -> Started:
    """The call's head and first chunk, retried once on another replica if its replica is lost first; 503 after that."""
    avoid: set[str] = set()
    for attempt in (0, 1):
        stream = aiter(open_call(replace(call, avoid=frozenset(avoid))))
        head: ResponseHead | None = None
        try:
            item = await anext(stream)
            if not isinstance(item, ResponseHead):
                raise TypeError(f"a replica answered {type(item).__name__} before its ResponseHead")
            head = item
            try:
                first = await anext(stream)
            except StopAsyncIteration:
                return Started(head, None, stream)
            if not isinstance(first, bytes):
                raise TypeError("a replica sent a second ResponseHead")
            return Started(head, first, stream)
        except lost as e:
            if head is not None:
                avoid.add(head.replica)
            if attempt == 0:
                stats.retries += 1
                continue
            stats.failed_before_send += 1
            raise unavailable(f"the replica serving this request was lost before answering, twice ({type(e).__name__}): retry later") from e
        except StopAsyncIteration as e:
            raise RuntimeError("a replica ended its answer without a ResponseHead") from e
    raise AssertionError("unreachable: the second attempt returns or raises")


def stream_error_event(message: str) -> bytes:
    body = unavailable(message).body()
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()


async def rest_of_body(started: Started, lost: tuple[type[BaseException], ...], stats: ForwardStats) -> AsyncIterator[bytes]:
    """The body after its first chunk. A replica lost now: an SSE stream ends with an error event (the client has a 200
    and part of the answer already); any other body cannot be mended, so the connection ends short and the client sees a
    truncated response rather than a wrong one."""
    if started.first is not None:
        yield started.first
    try:
        async for chunk in started.rest:
            if not isinstance(chunk, bytes):
                raise TypeError("a replica sent a second ResponseHead")
            yield chunk
    except lost as e:
        stats.failed_mid_stream += 1
        if dict(started.head.headers).get(b"content-type", b"").startswith(b"text/event-stream"):
            yield stream_error_event(f"replica {started.head.replica} was lost mid-stream ({type(e).__name__}): retry the request")
            return
        raise

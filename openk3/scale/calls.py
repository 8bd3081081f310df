"""What the front end sends a replica and what comes back: plain picklable values, the only types crossing Ray.

A `ReplicaCall` is one HTTP request, as bytes, plus what the router reads: the request's match-unit keys, the replicas to
avoid (one that just failed it) and, for the front end's per-replica reports, the one replica it is meant for. A replica
answers with a `ResponseHead` and then the body's chunks, as it produces them (SSE streams stay streams).

Prefill/decode disaggregation adds two fields: a prefill call carries the prompt's token ids (`prompt_ids`) and is
answered with a hand-off record (serve/cache/handoff.py) or None; the request's call to a decode replica then carries
that record (`record`), which the replica imports before it serves the request.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReplicaCall:
    method: str
    path: str
    query: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    keys: tuple[bytes, ...] = ()  # chained 64-token keys of the prompt (empty: nothing to match, route by load)
    request_id: str = ""
    avoid: frozenset[str] = field(default_factory=frozenset)
    target: str | None = None  # a replica id: the call is a report meant for that replica only
    prompt_ids: tuple[int, ...] = ()  # a prefill call: the prompt, as the decode replica's server will tokenise it
    record: bytes | None = None  # the prefill replica's hand-off record for this request's prompt (decode replicas)


@dataclass(frozen=True)
class ResponseHead:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    replica: str  # the replica's id, also sent to the client as the x-openk3-replica header


@dataclass(frozen=True)
class ReplicaReport:
    """One replica's own /health status and /metrics text (empty for a probe: a call to /health), for the front end."""

    replica: str
    health_status: int
    metrics_text: str


class WrongReplicaError(RuntimeError):
    """A report reached a replica other than its target (the target left the routing set meanwhile)."""

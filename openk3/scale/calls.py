"""What the front end sends a replica and what comes back: plain picklable values, the only types crossing Ray.

A `ReplicaCall` is one HTTP request, as bytes, plus what the router reads: the request's match-unit keys, the replicas to
avoid (one that just failed it) and, for the front end's per-replica reports, the one replica it is meant for. A replica
answers with a `ResponseHead` and then the body's chunks, as it produces them (SSE streams stay streams).

Prefill/decode disaggregation adds two fields: a prefill call carries the prompt's token ids (`prompt_ids`) and is
answered with a hand-off record (serve/cache/handoff.py) or None; the request's call to a decode replica then carries
that record (`record`), which the replica imports before it serves the request.

A cross-replica prefix pull (scale/prefix_pull.py) adds `pull`, set by the router on a request whose replica lacks a
prefix another replica holds, with the prompt's ids and `cache_salt`; the replica then sends that one an export call
(`target` the holder, `pull` the fewest units worth sending) answered with a record or None.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PullHint:
    """Another replica believed to hold the first `units` match units of a request's prompt (pull_hints.py); on an export
    call, the replica asked and the fewest units worth sending."""

    replica: str
    units: int


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
    # a prefill call, an export call, and a request that may pull a prefix: the prompt as the replica's server will tokenise it
    prompt_ids: tuple[int, ...] = ()
    record: bytes | None = None  # the prefill replica's hand-off record for this request's prompt (decode replicas)
    cache_salt: str | None = None  # the request's cache_salt, with prompt_ids: a pulled prefix is keyed under it
    pull: PullHint | None = None  # the router's hint: pull the prefix from this replica first (scale/prefix_pull.py)


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

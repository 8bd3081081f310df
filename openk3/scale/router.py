"""The prefix table as a Ray Serve request router (a `RequestRouter` for the engine replicas' deployment).

Ray's default router (power of two choices) probes two random replicas and takes the shorter queue: blind to caches.
Ray's `PrefixCacheAffinityRouter` (ray.serve.llm) matches prompt *text* in a character tree, and falls back to power of
two when load is imbalanced or the match rate is low. This one matches the engine's own unit: chained 64-token keys, so a
match is a boundary where the replica's prefix cache can hit; the front end computes them once (prompt_keys.py) and they
travel in the call. Ranks go best first; Ray's base class then takes, within a rank, the replica with the shortest queue
that accepts the request. A replica Ray reports dead, or drops from the set, is forgotten (its restart is empty).
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from openk3.scale.calls import ReplicaCall
from openk3.scale.prefix_table import PrefixTable, TableConfig


def _call_of(pending: PendingRequest | None) -> ReplicaCall | None:
    if pending is None or not pending.args or not isinstance(pending.args[0], ReplicaCall):
        return None
    return pending.args[0]


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, max_keys_per_replica: int = 1 << 16, max_imbalance: int = 4) -> None:  # type: ignore[override]
        self.table = PrefixTable(TableConfig(max_keys_per_replica, max_imbalance))

    async def choose_replicas(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        call = _call_of(pending_request)
        if call is not None and call.target is not None:
            # a report for one replica: only it (absent from this candidate set: none now, Ray asks again after a backoff)
            return [[by_id[call.target]]] if call.target in by_id else []
        keys = call.keys if call is not None else ()
        avoid = call.avoid if call is not None else frozenset()
        ranked = self.table.rank(keys, by_id, avoid)
        if not ranked:
            return []
        best = ranked[0]
        if best.matched_units == 0:
            # nothing cached anywhere: one rank, so the base class takes the shortest queue among all
            return [[by_id[c.replica] for c in ranked if c.replica not in avoid] or [by_id[c.replica] for c in ranked]]
        return [[by_id[c.replica]] for c in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        call = _call_of(pending_request)
        if call is None or call.target is not None:
            return
        self.table.routed(replica_id.unique_id, pending_request.metadata.internal_request_id, call.keys)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.table.completed(replica_id.unique_id, internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.table.retain(r.replica_id.unique_id for r in replicas)

"""The prefix table as a Ray Serve request router (a `RequestRouter` for the engine replicas' deployment).

Ray's default router (power of two choices) probes two random replicas and takes the shorter queue: blind to caches.
Ray's `PrefixCacheAffinityRouter` (ray.serve.llm) matches prompt *text* in a character tree, and falls back to power of
two when load is imbalanced or the match rate is low. This one matches the engine's own unit: chained 64-token keys, so a
match is a boundary where the replica's prefix cache can hit; the front end computes them once (prompt_keys.py) and they
travel in the call. Ranks go best first; Ray's base class then takes, within a rank, the replica with the shortest queue
that accepts the request. A replica Ray reports dead, or drops from the set, is forgotten (its restart is empty).

With pulls on (`pull_min_units`, scale/prefix_pull.py), a request that lands on a replica lacking a prefix another replica
is believed to hold (pull_hints.py) carries a hint naming that one: Ray sends the `PendingRequest`'s args as they are
after routing, so the hint is written into the call there.

Both routers here (this one, and `TargetedPowerOfTwoRouter`: Ray's default with the targeting below) honour a report
call's `target` (the front end asks each replica for its /health and /metrics by id), and both ask Ray to back off
between routing attempts (`routing_context.should_backoff`): without it Ray's routing loop retries at once, and a call
that finds no replica (a report for a replica not yet, or no longer, in the set; every replica at capacity) spins the
front end's event loop until nothing else runs there, requests and replica-set updates included.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import LocalityMixin, MultiplexMixin, PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from openk3.scale.calls import ReplicaCall
from openk3.scale.prefix_table import PrefixTable, TableConfig
from openk3.scale.pull_hints import PullHints


def _call_of(pending: PendingRequest | None) -> ReplicaCall | None:
    if pending is None or not pending.args or not isinstance(pending.args[0], ReplicaCall):
        return None
    return pending.args[0]


def _targeted(candidate_replicas: list[RunningReplica], call: ReplicaCall | None) -> list[list[RunningReplica]] | None:
    """A report call's one replica (none while it is absent from the set: Ray asks again after a backoff); None for any
    other call."""
    if call is None or call.target is None:
        return None
    return [[r] for r in candidate_replicas if r.replica_id.unique_id == call.target]


def _back_off(pending: PendingRequest | None) -> None:
    if pending is not None:
        pending.routing_context.should_backoff = True


class PrefixAffinityRouter(RequestRouter):
    def initialize_state(self, max_keys_per_replica: int = 1 << 16, max_imbalance: int = 4, pull_min_units: int | None = None) -> None:  # type: ignore[override]
        """pull_min_units: hint a pull when another replica holds at least this many units more (None: no pulls)."""
        self.table = PrefixTable(TableConfig(max_keys_per_replica, max_imbalance))
        self.pulls = None if pull_min_units is None else PullHints(pull_min_units, max_keys_per_replica)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        _back_off(pending_request)
        call = _call_of(pending_request)
        targeted = _targeted(candidate_replicas, call)
        if targeted is not None:
            return targeted
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        keys = call.keys if call is not None else ()
        avoid = call.avoid if call is not None else frozenset()
        ranked = self.table.rank(keys, by_id, avoid)
        if not ranked:
            return []
        if pending_request is not None:
            self.table.chosen(ranked[0].replica, pending_request.metadata.internal_request_id)
            if call is not None:
                self._hint(pending_request, call, ranked[0].replica, by_id)
        # one rank per replica, in the table's order (a new conversation: the replica sent the fewest requests first)
        return [[by_id[c.replica]] for c in ranked]

    def _hint(self, pending: PendingRequest, call: ReplicaCall, landing: str, alive: Iterable[str]) -> None:
        """Write a pull hint into the call when `landing` lacks a prefix another replica holds (a call with its prompt ids
        only: the front end sends them when pulls are on)."""
        if self.pulls is None or not call.prompt_ids:
            return
        hint = self.pulls.hint(call.keys, landing, alive)
        self.pulls.sent(landing, call.keys)
        if hint is not None:
            pending.args[0] = replace(call, pull=hint)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: ReplicaResult) -> None:
        call = _call_of(pending_request)
        if call is None or call.target is not None:
            return
        self.table.routed(replica_id.unique_id, pending_request.metadata.internal_request_id, call.keys)
        if self.pulls is not None:
            self.pulls.sent(replica_id.unique_id, call.keys)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.table.completed(replica_id.unique_id, internal_request_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.table.forget(replica_id.unique_id)
        if self.pulls is not None:
            self.pulls.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.table.retain(r.replica_id.unique_id for r in replicas)
        if self.pulls is not None:
            self.pulls.retain(r.replica_id.unique_id for r in replicas)


class TargetedPowerOfTwoRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Ray's default power-of-two choices (the `--replica-router pow2` baseline), sending a report call to its target
    replica. Ray's own class also has FIFOMixin, which hands a replica chosen for one call to the oldest pending call:
    a report would reach a replica it was not meant for. Without it, as here, Ray matches each replica to the exact
    call it was chosen for (calls are then served out of arrival order, which the front end does not rely on)."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        targeted = _targeted(candidate_replicas, _call_of(pending_request))
        if targeted is not None:
            _back_off(pending_request)
            return targeted
        # Ray's procedure as it is (it reads only what the mixins and the base class give every router)
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)  # type: ignore[arg-type]

"""The front end's view of its replicas' health: probed in the background with a time bound, read without waiting.

A probe asks each pool for its replica ids and each replica for its /health, every `period_s`, each answer bounded by
`timeout_s`: a replica that dies, or stalls, is unhealthy within period_s + timeout_s, and `/health` reads the last
probe's state at once instead of waiting on a replica that cannot answer. A replica the request path found dead (a
call that raised Ray's ActorDiedError) is marked lost at once, and stays unhealthy whatever a probe that was already
in flight reports (a dead actor never comes back: Ray replaces it with a new id); any loss also wakes the probe loop.

A pool with no healthy replica is `down`: `wait_down(pool)` returns when it is, so a call waiting on that pool (a
prefill whose only replica was lost, which Ray would hold until it starts a replacement) can give up and fall back.

`list_ids(pool)` and `probe(pool, replica)` are the Ray side (frontend.py); tests give fakes. Runs on one event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from openk3.checks import check_number

log = logging.getLogger("openk3.scale")

ListIds = Callable[[str], Awaitable[list[str]]]
Probe = Callable[[str, str], Awaitable[int]]  # the replica's /health status (200: healthy)
T = TypeVar("T")


class PoolDownError(RuntimeError):
    """A call given up because every replica of its pool is unhealthy."""


@dataclass(frozen=True)
class ProbeConfig:
    period_s: float = 0.5  # between the end of one probe and the start of the next
    timeout_s: float = 2.0  # one replica's answer, and one pool's id listing

    def __post_init__(self) -> None:
        check_number("ProbeConfig", "period_s", self.period_s, low=0.01)
        check_number("ProbeConfig", "timeout_s", self.timeout_s, low=0.01)


@dataclass(frozen=True)
class ReplicaState:
    healthy: bool
    line: str  # "health 200", or why not ("TimeoutError: no answer within 2 s", "lost: ActorDiedError ...")


class HealthBoard:
    def __init__(self, pools: Mapping[str, int], list_ids: ListIds, probe: Probe, config: ProbeConfig, clock: Callable[[], float] = time.monotonic) -> None:
        """pools: each pool's name and the replicas it is deployed with (one missing from the listing counts unhealthy)."""
        self.expected, self.config, self.clock = dict(pools), config, clock
        self.pools = list(pools)
        self._list_ids, self._probe = list_ids, probe
        self.states: dict[str, dict[str, ReplicaState]] = {p: {} for p in self.pools}
        self.probed_at: float | None = None  # clock() when the last probe finished; None before the first
        self._down = {p: asyncio.Event() for p in self.pools}
        self._probed = asyncio.Event()
        self._wake = asyncio.Event()
        self._lost: dict[tuple[str, str], str] = {}  # (pool, replica) found dead -> why; dropped once no longer listed

    def healthy(self, pool: str) -> int:
        return sum(s.healthy for s in self.states[pool].values())

    def unhealthy(self, pool: str) -> int:
        """Replicas listed but not healthy, or not listed at all (dead and not yet replaced), of those deployed."""
        return max(self.expected[pool], len(self.states[pool])) - self.healthy(pool)

    def is_down(self, pool: str) -> bool:
        """No healthy replica in `pool` by the last probe (False before the first probe: nothing is known yet)."""
        return self._down[pool].is_set()

    async def wait_down(self, pool: str) -> None:
        await self._down[pool].wait()

    async def wait_probed(self) -> None:
        await self._probed.wait()

    def mark_lost(self, pool: str, replica: str, why: str) -> None:
        """A call on the request path found `replica` dead: unhealthy now and for good, and the next probe comes at once."""
        self._lost[(pool, replica)] = why
        if replica in self.states[pool]:
            self.states[pool][replica] = ReplicaState(False, f"lost: {why}")
        self._update(pool)
        self.wake()

    def wake(self) -> None:
        """Probe now rather than after the period (the request path saw a replica fail)."""
        self._wake.set()

    async def probe_once(self) -> None:
        """Probe every pool's replicas, concurrently, each bounded by timeout_s, and replace the board's state."""

        async def one(pool: str, replica: str) -> ReplicaState:
            try:
                status = await asyncio.wait_for(self._probe(pool, replica), self.config.timeout_s)
            except TimeoutError:
                return ReplicaState(False, f"TimeoutError: no answer within {self.config.timeout_s:g} s")
            except Exception as e:  # one replica's failure is its line on the board, never the front end's error
                return ReplicaState(False, f"{type(e).__name__}: {e}".splitlines()[0])
            return ReplicaState(status == 200, f"health {status}")

        async def pool_ids(pool: str) -> list[str] | None:
            try:
                return await asyncio.wait_for(self._list_ids(pool), self.config.timeout_s)
            except Exception as e:
                log.warning("health probe: the replicas of %s could not be listed (%s: %s); keeping the last state", pool, type(e).__name__, e)
                return None

        listed = await asyncio.gather(*(pool_ids(p) for p in self.pools))
        found = [(p, r) for p, ids in zip(self.pools, listed, strict=True) if ids is not None for r in ids]
        results = await asyncio.gather(*(one(p, r) for p, r in found))
        fresh: dict[str, dict[str, ReplicaState]] = {p: {} for p, ids in zip(self.pools, listed, strict=True) if ids is not None}
        for (p, r), state in zip(found, results, strict=True):
            why = self._lost.get((p, r))
            fresh[p][r] = state if why is None else ReplicaState(False, f"lost: {why}")
        self._lost = {(p, r): why for (p, r), why in self._lost.items() if p not in fresh or r in fresh[p]}
        for p, states in fresh.items():
            for r, state in states.items():
                before = self.states[p].get(r)
                if before is not None and before.healthy != state.healthy:
                    log.warning("replica %s of %s: %s -> %s", r, p, before.line, state.line)
            self.states[p] = states
            self._update(p)
        self.probed_at = self.clock()
        self._probed.set()

    async def run(self) -> None:
        """Probe forever, period_s apart or at once when woken (the caller's task; cancel it to stop)."""
        while True:
            self._wake.clear()
            await self.probe_once()
            try:
                await asyncio.wait_for(self._wake.wait(), self.config.period_s)
            except TimeoutError:
                pass

    def _update(self, pool: str) -> None:
        if self.healthy(pool) == 0:
            self._down[pool].set()
        else:
            self._down[pool].clear()

    def summary(self) -> dict[str, object]:
        """What /health answers: counts over every pool, per pool (with the replicas deployed), and each replica's line."""
        replicas = {r: s.line for p in self.pools for r, s in self.states[p].items()}
        pools = {p: {"healthy": self.healthy(p), "unhealthy": self.unhealthy(p), "deployed": self.expected[p]} for p in self.pools}
        age = None if self.probed_at is None else round(self.clock() - self.probed_at, 3)
        healthy, unhealthy = sum(self.healthy(p) for p in self.pools), sum(self.unhealthy(p) for p in self.pools)
        return {"healthy": healthy, "unhealthy": unhealthy, "pools": pools, "replicas": replicas, "probe_age_s": age}


async def until_down(board: HealthBoard, pool: str, call: Awaitable[T], give_up: Callable[[], object] | None = None) -> T:
    """`call`'s answer, or PoolDownError as soon as `pool` is down (at once when it already is): the call is then
    cancelled, and `give_up` run (Ray's DeploymentResponse.cancel, so Ray drops a call still waiting for a replica)."""
    task = asyncio.ensure_future(call)
    down = asyncio.ensure_future(board.wait_down(pool))
    try:
        await asyncio.wait({task, down}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        down.cancel()
        answered = task.done()
        if not answered:
            task.cancel()
            if give_up is not None:
                give_up()
    if not answered:
        raise PoolDownError(f"every replica of {pool} is unhealthy: the call was given up")
    return task.result()

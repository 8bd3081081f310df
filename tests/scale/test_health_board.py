"""The front end's health board with fake replicas and injected faults (no Ray, a fake clock): a replica that dies or
stalls is unhealthy after one bounded probe, /health's summary is read without waiting, a pool left without a healthy
replica is down, and a call waiting on a down pool is given up (the prefill fallback) while one on a live pool is not;
and the front end's own prefill call, held as Ray holds it, falls back and is counted when the pool goes down."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from typing import Any

import pytest

from openk3.scale.health_board import HealthBoard, PoolDownError, ProbeConfig, until_down


class FakeFleet:
    """Pools of replica ids; each replica answers its probe with a status, raises, or never answers (stalled)."""

    def __init__(self, pools: dict[str, list[str]]) -> None:
        self.pools = pools
        self.status: dict[str, int] = {r: 200 for ids in pools.values() for r in ids}
        self.dead: set[str] = set()
        self.stalled: set[str] = set()

    async def list_ids(self, pool: str) -> list[str]:
        return list(self.pools[pool])

    async def probe(self, pool: str, replica: str) -> int:
        if replica in self.dead:
            raise ConnectionError(f"replica {replica} died")
        if replica in self.stalled:
            await asyncio.Event().wait()  # never answers: only the probe's timeout ends it
        return self.status[replica]


def board_of(fleet: FakeFleet, clock: list[float]) -> HealthBoard:
    return HealthBoard(
        {p: len(ids) for p, ids in fleet.pools.items()}, fleet.list_ids, fleet.probe, ProbeConfig(period_s=0.5, timeout_s=0.05), clock=lambda: clock[0]
    )


def test_dead_stalled_and_failing_replicas_are_unhealthy_after_one_probe() -> None:
    async def go() -> None:
        fleet, clock = FakeFleet({"decode": ["d1", "d2", "d3"], "prefill": ["p1"]}), [100.0]
        board = board_of(fleet, clock)
        assert not board.is_down("prefill") and board.probed_at is None  # nothing known before the first probe
        await board.probe_once()
        assert board.summary()["healthy"] == 4 and not board.is_down("prefill")
        fleet.dead.add("p1")
        fleet.stalled.add("d2")
        fleet.status["d3"] = 503
        clock[0] = 101.0
        await board.probe_once()
        s = board.summary()
        assert (s["healthy"], s["unhealthy"]) == (1, 3)
        assert s["pools"] == {"decode": {"healthy": 1, "unhealthy": 2, "deployed": 3}, "prefill": {"healthy": 0, "unhealthy": 1, "deployed": 1}}
        lines = s["replicas"]
        assert isinstance(lines, dict)
        assert lines["p1"] == "ConnectionError: replica p1 died" and lines["d3"] == "health 503"
        assert lines["d2"].startswith("TimeoutError: no answer within 0.05 s")
        assert board.is_down("prefill") and not board.is_down("decode")
        clock[0] = 101.25
        assert board.summary()["probe_age_s"] == 0.25  # read from the board, not probed again

    asyncio.run(go())


def test_a_replica_gone_from_the_listing_leaves_the_board_and_its_replacement_joins() -> None:
    async def go() -> None:
        fleet, clock = FakeFleet({"prefill": ["p1"]}), [0.0]
        board = board_of(fleet, clock)
        await board.probe_once()
        fleet.pools["prefill"] = []  # Ray dropped the dead replica's name; its replacement has not registered yet
        await board.probe_once()
        assert board.is_down("prefill") and board.summary()["replicas"] == {}
        assert board.summary()["pools"] == {"prefill": {"healthy": 0, "unhealthy": 1, "deployed": 1}}  # missing counts
        fleet.pools["prefill"] = ["p2"]
        fleet.status["p2"] = 200
        await board.probe_once()
        assert not board.is_down("prefill") and board.summary()["replicas"] == {"p2": "health 200"}

    asyncio.run(go())


def test_a_replica_found_dead_stays_unhealthy_whatever_a_probe_already_in_flight_says() -> None:
    async def go() -> None:
        fleet, clock = FakeFleet({"prefill": ["p1"]}), [0.0]
        board = board_of(fleet, clock)
        board.config = ProbeConfig(period_s=0.5, timeout_s=60.0)  # the gate below, not the timeout, ends the probe
        await board.probe_once()
        gate, asked = asyncio.Event(), asyncio.Event()
        answered_before_the_death = fleet.probe

        async def slow(pool: str, replica: str) -> int:
            status = await answered_before_the_death(pool, replica)  # 200: asked while it was alive
            asked.set()
            await gate.wait()
            return status

        board._probe = slow
        probing = asyncio.ensure_future(board.probe_once())
        await asked.wait()
        board.mark_lost("prefill", "p1", "ActorDiedError")  # the request path found it dead meanwhile
        assert board.is_down("prefill") and board.summary()["replicas"] == {"p1": "lost: ActorDiedError"}
        gate.set()
        await probing
        assert board.is_down("prefill") and board.summary()["replicas"] == {"p1": "lost: ActorDiedError"}
        fleet.pools["prefill"] = ["p2"]  # Ray dropped its name and started a replacement
        fleet.status["p2"] = 200
        board._probe = fleet.probe
        await board.probe_once()
        assert not board.is_down("prefill") and board.summary()["replicas"] == {"p2": "health 200"}

    asyncio.run(go())


def test_a_call_waiting_on_a_pool_that_goes_down_is_given_up_and_one_on_a_live_pool_is_answered() -> None:
    async def go() -> None:
        fleet, clock = FakeFleet({"prefill": ["p1"]}), [0.0]
        board = board_of(fleet, clock)
        await board.probe_once()
        never = asyncio.Event()
        gave_up: list[bool] = []

        async def held() -> bytes:  # Ray holding a call until a replacement replica starts
            await never.wait()
            return b"record"

        waiting = asyncio.ensure_future(until_down(board, "prefill", held(), lambda: gave_up.append(True)))
        await asyncio.sleep(0)
        assert not waiting.done()
        fleet.dead.add("p1")
        await board.probe_once()
        with pytest.raises(PoolDownError, match="every replica of prefill is unhealthy"):
            await waiting
        assert gave_up == [True]
        with pytest.raises(PoolDownError):  # already down: given up at once
            await until_down(board, "prefill", held())

        fleet.dead.clear()
        await board.probe_once()

        async def answered() -> bytes:
            return b"record"

        assert await until_down(board, "prefill", answered()) == b"record"

    asyncio.run(go())


def test_probe_config_names_a_bad_field() -> None:
    with pytest.raises(ValueError, match=r"ProbeConfig.timeout_s=0 is invalid"):
        ProbeConfig(timeout_s=0)


class HeldResponse:
    """A Ray DeploymentResponse that never resolves (Ray waiting for a replacement replica), and records its cancel()."""

    def __init__(self) -> None:
        self.cancelled = False

    def __await__(self) -> Generator[Any, None, bytes]:
        return self._never().__await__()

    async def _never(self) -> bytes:
        await asyncio.Event().wait()
        return b"record"

    def cancel(self) -> None:
        self.cancelled = True


class HeldPrefillPool:
    def __init__(self) -> None:
        self.prefill = self  # handle.prefill.remote(call)
        self.responses: list[HeldResponse] = []

    def remote(self, call: object) -> HeldResponse:
        self.responses.append(HeldResponse())
        return self.responses[-1]


def test_the_front_ends_prefill_falls_back_once_the_pool_is_down_and_skips_it_while_it_stays_down() -> None:
    pytest.importorskip("ray.serve", reason="ray[serve] is not installed (the `ray` extra)")
    from openk3.scale.calls import ReplicaCall
    from openk3.scale.frontend import Frontend, HandoffStats

    async def go() -> None:
        fleet, clock = FakeFleet({"PrefillReplica": ["p1"]}), [0.0]
        front = Frontend.__new__(Frontend)  # only what _prefill reads: no tokenizer, no Ray handles
        pool = HeldPrefillPool()
        front.prefill, front.prefill_deployment, front.handoff = pool, "PrefillReplica", HandoffStats()  # type: ignore[assignment]
        front.board = board_of(fleet, clock)
        await front.board.probe_once()
        call = ReplicaCall("POST", "/v1/completions", prompt_ids=(1, 2, 3))
        waiting = asyncio.ensure_future(front._prefill(call))
        await asyncio.sleep(0)
        assert not waiting.done() and len(pool.responses) == 1
        fleet.dead.add("p1")  # the prefill replica is killed: Ray would hold the call until a replacement starts
        await front.board.probe_once()
        assert await waiting is None  # given up: the decode replica computes the whole prompt
        assert pool.responses[0].cancelled and front.handoff.prefill_failures == 1
        assert await front._prefill(call) is None  # still down: skipped without a call
        assert len(pool.responses) == 1 and front.handoff.prefill_failures == 2

    asyncio.run(go())

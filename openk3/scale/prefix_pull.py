"""Cross-replica prefix pull, the replicas' side: a replica that lacks a prefix another replica holds imports that one's
cached state (MLA latents + KDA snapshot, one tier record) instead of computing it, as LMCache's P2P sharing or SGLang's
HiCache do across instances.

Flow: the router puts a hint on a request (pull_hints.py: replica A is believed to hold `units` match units of its prompt).
The replica B it lands on, before its engine sees the request (`PrefixPuller.before`): looks up its own cache; when A's
hint is at least one match unit deeper, sends A an export call for the prompt (through the router, targeted at A) and
imports the record A answers (serve/prefix_pull.py checks it is this prompt's prefix under B's model salt and the
request's cache_salt); the request then hits it like any cached prefix. Exactly one transfer per prefix per replica:
requests on B whose prompts carry the key of a prefix being pulled wait for that pull (hinted or not: the router hints
only B's first request for it), and a later one finds it in B's own cache.
A answers (`export`) with the deepest boundary of the prompt it holds in any tier; while its own engine is still
prefilling toward it (a burst of new conversations: A's first one computes the shared system prompt while B's first one
arrives) it asks again after each engine step, up to `max_wait_steps`. A pull that brings nothing -- A had evicted it, A
is gone, the record is refused, no answer within `timeout_s` -- is counted (`openk3:prefix_cache_remote_pull_failures`)
and the request computes its prompt: never an error for the client.
A holder may itself be pulling the prefix (`PrefixPuller.export`): with more than two replicas, a burst of new
conversations lands the shared system prompt's first request on A, the second on B (hinted to pull from A), the third on
C, hinted to pull from B, the replica most recently sent it; B's engine has not seen its request yet (it waits for its
pull), so without waiting B would answer nothing and C would compute the prompt. B answers once its own pull has ended
(from its inbox, or, when the pull brought nothing, after the steps of its own prefill). The wait is bounded by B's pull's
`timeout_s`; two replicas each pulling a prefix from the other (possible only when the router forgot that one of them
was sent it first) end both at their timeouts and compute it. What it costs: B's request waits for A's answer
(at most A's prefill of the prefix, when A is computing it) and one record of buffer_nbytes(prefix) crosses Ray.
The engine calls and the export call are injected, so this is tested without Ray (tests/scale/test_prefix_pull.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from openk3.checks import check_int, check_number
from openk3.scale.calls import PullHint, ReplicaCall
from openk3.serve import prefix_pull
from openk3.serve.engine import LLMEngine

log = logging.getLogger("openk3.scale")
T = TypeVar("T")
EngineCall = Callable[[Callable[[LLMEngine], T]], Awaitable[T]]  # AsyncEngine.call: run on the engine thread, between steps
ExportCall = Callable[[ReplicaCall], Awaitable[bytes | None]]  # the holder's `export`, reached through the router


@dataclass(frozen=True)
class PullConfig:
    match_unit: int  # the engines' prefix match unit: the router's keys stand for multiples of it
    timeout_s: float = 30.0  # a holder that has not answered by then (lost, or stuck) is given up: the prompt is computed
    max_wait_steps: int = 256  # a holder's engine steps an export waits for its own prefill toward the prefix

    def __post_init__(self) -> None:
        check_int("PullConfig", "match_unit", self.match_unit, low=1)
        check_number("PullConfig", "timeout_s", self.timeout_s, low=0)
        check_int("PullConfig", "max_wait_steps", self.max_wait_steps, low=0)


async def export(engine_call: EngineCall[Any], call: ReplicaCall, config: PullConfig) -> bytes | None:
    """The holder's answer to an export call: the record of the deepest boundary of `call.prompt_ids` it holds, at least
    `call.pull.units` match units deep, waiting a step at a time while its own prefill toward it runs; None without one."""
    assert call.pull is not None, "an export call carries the fewest units worth sending"
    ids, salt, min_tokens = list(call.prompt_ids), call.cache_salt, call.pull.units * config.match_unit
    for _ in range(config.max_wait_steps + 1):
        answer: prefix_pull.PullAnswer = await engine_call(lambda e: prefix_pull.export_from(e, ids, salt, min_tokens))
        if not answer.pending:
            return answer.record
    return None


class PrefixPuller:
    """One replica's pulls (module docstring): `engine_call` reaches its engine, `export_call` another replica."""

    def __init__(self, replica_id: str, engine_call: EngineCall[Any], export_call: ExportCall, config: PullConfig) -> None:
        self.replica_id = replica_id
        self.engine_call = engine_call
        self.export_call = export_call
        self.config = config
        self._pulling: dict[bytes, asyncio.Task[None]] = {}  # the router's key of a prefix -> its pull under way

    def _under_way(self, keys: Sequence[bytes]) -> asyncio.Task[None] | None:
        """This replica's pull under way of the deepest prefix of `keys` (the router's keys of a prompt) it is pulling."""
        return next((self._pulling[k] for k in reversed(keys) if k in self._pulling), None)

    async def export(self, call: ReplicaCall) -> bytes | None:
        """Another replica's pull from this one (`call.keys`: the router's keys of the prefix): waits for this replica's own
        pull of it, if one is under way (module docstring), then answers as `export` does."""
        under_way = self._under_way(call.keys)
        if under_way is not None:
            await asyncio.shield(under_way)  # the puller leaving (its timeout) does not cancel this replica's pull
        return await export(self.engine_call, call, self.config)

    async def before(self, call: ReplicaCall) -> None:
        """Wait for a pull under way of a prefix of this request (another request's), then pull the prefix `call.pull`
        names, unless this replica holds it already or it is not worth a unit; returns when the pulls have ended, however
        they ended. A request without a hint also waits: its replica's first request pulls the shared system prompt while
        the second, which the router sends there without a hint (it counts the replica as holding it already), would
        otherwise compute it at once."""
        under_way = self._under_way(call.keys)
        hint, ids = call.pull, list(call.prompt_ids)
        if hint is not None and hint.replica != self.replica_id and len(ids) >= 2 and 0 < hint.units <= len(call.keys):
            key = call.keys[hint.units - 1]
            if key not in self._pulling:  # registered before any await: a request arriving meanwhile finds it
                task = asyncio.get_running_loop().create_task(self._pull(hint, ids, call.keys[: hint.units], call.cache_salt, call.request_id))
                self._pulling[key] = task
                task.add_done_callback(lambda _: self._pulling.pop(key, None))
            under_way = self._pulling[key]
        if under_way is not None:
            await asyncio.shield(under_way)  # a client that leaves does not cancel a pull other requests may be waiting for

    async def _pull(self, hint: PullHint, ids: list[int], keys: tuple[bytes, ...], salt: str | None, request_id: str) -> None:
        unit = self.config.match_unit
        want = min(hint.units * unit, len(ids) - 1)
        own: int = await self.engine_call(lambda e: e.cache.match_prefix(ids, salt).num_tokens)
        if want - own < unit:
            return
        holder, min_units = hint.replica, own // unit + 1
        # the keys let a holder that is pulling this prefix itself answer after its pull (`export`); a targeted call is
        # routed by its target alone, so they do not enter the router's prefix table
        export_call = ReplicaCall("POST", "/export", keys=keys, target=holder, prompt_ids=tuple(ids), cache_salt=salt, pull=PullHint(holder, min_units))
        try:
            record = await asyncio.wait_for(self.export_call(export_call), self.config.timeout_s)
        except Exception as e:  # the holder is gone, or did not answer in time: this replica computes the prompt
            log.warning("replica %s: prefix pull from %s for request %s failed (%s: %s)", self.replica_id, holder, request_id, type(e).__name__, e)
            await self.engine_call(lambda e: prefix_pull.count_pull_failure(e.cache))
            return
        if record is None:  # evicted on the holder, or never computed there
            await self.engine_call(lambda e: prefix_pull.count_pull_failure(e.cache))
            return
        try:
            await self.engine_call(lambda e: prefix_pull.import_pulled(e.cache, record, ids, salt))
        except ValueError as e:  # refused (counted by import_pulled): another model's, another salt's, or damaged
            log.warning("replica %s: prefix record from %s refused, request %s computes its prompt: %s", self.replica_id, holder, request_id, e)

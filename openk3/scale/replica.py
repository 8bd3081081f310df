"""One engine replica: the `openk3 serve` app (built as the launch layer says, ReplicaLaunch.build_server: the engine, the
AsyncEngine front end and the OpenAI routes) inside a Ray Serve replica, called in-process for each forwarded request
(asgi_call.py).

The replica starts its engine in its (async) constructor, so Ray counts it RUNNING only once it can serve. Ray's health
check asks the app's own /health, which fails once the engine loop has died: Ray then replaces the replica, as a
supervisor restarts a failed `openk3 serve` process.

With prefill/decode disaggregation the same class serves both pools: a prefill replica answers `prefill` (compute the
prompt but its last token, export the boundary there: serve/cache/handoff.py's protocol), a decode replica imports the
record a call carries before it serves the request, which then hits the record and computes only the last prompt token.
A record refused at import (corrupted, another model's shape) is logged and the request recomputes its prompt.

A request the router marked with a pull hint first pulls the prefix another replica of the pool holds (prefix_pull.py:
`forward` runs PrefixPuller.before, which calls the holder's `export` through this deployment's own handle, targeted).

A replica of several ranks (`--tp/--ep/--dp` with `--replicas`) spawns its other ranks on its own node, as `LLM(ep=N)`
does (launch/replicas.py build_replica_server); Ray reserves every rank's CPUs (and GPUs) for the replica's actor
(deploy.py), and the replica's shutdown stops them.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager

from ray import serve

from openk3.scale.asgi_call import ResponseStart, asgi_call
from openk3.scale.calls import ReplicaCall, ReplicaReport, ResponseHead, WrongReplicaError
from openk3.scale.forward import REPLICA_HEADER
from openk3.scale.prefix_pull import PrefixPuller, PullConfig
from openk3.scale.replica_launch import ReplicaLaunch, SpawnedRanks
from openk3.serve.output import OutputKind
from openk3.serve.sampling import SamplingParams

log = logging.getLogger("openk3.scale")
# the prefill side of a hand-off: one greedy token after P[:-1] leaves the snapshot at len(P) - 1; the token is discarded
PREFILL = SamplingParams(temperature=0, max_tokens=1)


class EngineReplica:
    # Ray Serve awaits an async constructor (replicas may start their engines here); type checkers want None from __init__
    async def __init__(self, launch: ReplicaLaunch) -> None:  # type: ignore[misc]
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self._pool = (context.app_name, context.deployment)
        self._pull = PullConfig(launch.engine.prefix_match_unit)
        self._puller: PrefixPuller | None = None  # made at the first hint or export: this deployment's handle needs the app to be up
        self._ranks: SpawnedRanks | None  # a multi-rank replica's other ranks
        self.app, self._ranks = launch.build_server(launch.serve_args)
        self._lifespan: AbstractAsyncContextManager[object] = self.app.router.lifespan_context(self.app)
        try:
            await self._lifespan.__aenter__()
        except BaseException:
            if self._ranks is not None:  # a constructor that fails gets no __del__: stop the spawned ranks here
                await asyncio.to_thread(self._ranks.close)
            raise
        log.info("replica %s: engine started", self.replica_id)

    async def __del__(self) -> None:
        """Ray Serve's shutdown of this replica: drain the server (its lifespan's end), then stop its other ranks."""
        try:
            await self._lifespan.__aexit__(None, None, None)
        finally:
            if self._ranks is not None:
                await asyncio.to_thread(self._ranks.close)

    async def forward(self, call: ReplicaCall) -> AsyncIterator[ResponseHead | bytes]:
        """The app's answer to `call`: its head (with this replica's id), then its body chunks as they are made."""
        if call.record is not None:
            await self._import(call.record)
        if call.prompt_ids:  # pulls are on (the front end sent the prompt): pull, or wait for a pull under way of this prefix
            await self._pulls().before(call)
        async for item in asgi_call(self.app, call):
            if isinstance(item, ResponseStart):
                yield ResponseHead(item.status, (*item.headers, (REPLICA_HEADER, self.replica_id.encode())), self.replica_id)
            else:
                yield item

    async def prefill(self, call: ReplicaCall) -> bytes | None:
        """Compute `call.prompt_ids` but its last token and return the record of that boundary (None: the prompt is too
        short to hand off, or this engine refused it; the decode replica then computes it and answers any error)."""
        prompt = list(call.prompt_ids)
        if len(prompt) < 2:
            return None
        frontend = self.app.state.served.frontend
        try:
            async for _ in frontend.generate(f"prefill-{call.request_id or uuid.uuid4().hex}", prompt[:-1], PREFILL, OutputKind.FINAL_ONLY):
                pass
        except ValueError as e:  # the prompt does not fit this engine (too long, ids outside the vocabulary)
            log.info("replica %s: no prefill for request %s: %s", self.replica_id, call.request_id, e)
            return None
        record: bytes | None = await frontend.call(lambda engine: engine.export_prefix(prompt[:-1]))
        return record

    def _pulls(self) -> PrefixPuller:
        if self._puller is None:
            handle = serve.get_deployment_handle(self._pool[1], self._pool[0])

            async def export_call(call: ReplicaCall) -> bytes | None:
                # a context of its own, so Ray gives the call an internal request id apart from the request's (frontend.py
                # own_request_id says why); the router honours `target`
                record: bytes | None = await contextvars.Context().run(lambda: handle.export.remote(call))
                return record

            self._puller = PrefixPuller(self.replica_id, self.app.state.served.frontend.call, export_call, self._pull)
        return self._puller

    async def export(self, call: ReplicaCall) -> bytes | None:
        """Another replica's pull: the record of the deepest prefix of `call.prompt_ids` this replica holds (prefix_pull.py)."""
        if call.target != self.replica_id:
            raise WrongReplicaError(f"an export for replica {call.target} reached replica {self.replica_id}")
        return await self._pulls().export(call)

    async def _import(self, record: bytes) -> None:
        try:
            await self.app.state.served.frontend.call(lambda engine: engine.import_prefix(record))
        except Exception as e:  # a record this engine cannot take (TierRecordError: corrupted, another shape) costs a recompute
            log.warning("replica %s: hand-off record refused (%s), the prompt is recomputed: %s", self.replica_id, type(e).__name__, e)

    async def report(self, call: ReplicaCall) -> ReplicaReport:
        """This replica's /health status and, unless the call's path is /health (the front end's probe), its /metrics text."""
        if call.target != self.replica_id:
            raise WrongReplicaError(f"a report for replica {call.target} reached replica {self.replica_id}")
        metrics = "" if call.path == "/health" else (await self._body("/metrics")).decode()
        return ReplicaReport(self.replica_id, await self._status("/health"), metrics)

    async def check_health(self) -> None:
        status = await self._status("/health")
        if status != 200:
            raise RuntimeError(f"replica {self.replica_id}: /health answered {status} (the engine loop is down)")

    async def _status(self, path: str) -> int:
        status = 0
        async for item in asgi_call(self.app, ReplicaCall("GET", path)):
            if isinstance(item, ResponseStart):
                status = item.status
        return status

    async def _body(self, path: str) -> bytes:
        return b"".join([item async for item in asgi_call(self.app, ReplicaCall("GET", path)) if isinstance(item, bytes)])

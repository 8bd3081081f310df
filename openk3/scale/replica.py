"""One engine replica: the `openk3 serve` app (api/cli.py's build_server: the LLMEngine, the AsyncEngine front end and the
OpenAI routes) inside a Ray Serve replica, called in-process for each forwarded request (asgi_call.py).

The replica starts its engine in its (async) constructor, so Ray counts it RUNNING only once it can serve. Ray's health
check asks the app's own /health, which fails once the engine loop has died: Ray then replaces the replica, as a
supervisor restarts a failed `openk3 serve` process.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager

from ray import serve

from openk3.scale.asgi_call import ResponseStart, asgi_call
from openk3.scale.calls import ReplicaCall, ReplicaReport, ResponseHead, WrongReplicaError
from openk3.scale.forward import REPLICA_HEADER

log = logging.getLogger("openk3.scale")


class EngineReplica:
    # Ray Serve awaits an async constructor (replicas may start their engines here); type checkers want None from __init__
    async def __init__(self, serve_args: argparse.Namespace) -> None:  # type: ignore[misc]
        from openk3.api.cli import build_server

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.app = build_server(serve_args)
        self._lifespan: AbstractAsyncContextManager[object] = self.app.router.lifespan_context(self.app)
        await self._lifespan.__aenter__()
        log.info("replica %s: engine started", self.replica_id)

    async def forward(self, call: ReplicaCall) -> AsyncIterator[ResponseHead | bytes]:
        """The app's answer to `call`: its head (with this replica's id), then its body chunks as they are made."""
        async for item in asgi_call(self.app, call):
            if isinstance(item, ResponseStart):
                yield ResponseHead(item.status, (*item.headers, (REPLICA_HEADER, self.replica_id.encode())), self.replica_id)
            else:
                yield item

    async def report(self, call: ReplicaCall) -> ReplicaReport:
        if call.target != self.replica_id:
            raise WrongReplicaError(f"a report for replica {call.target} reached replica {self.replica_id}")
        return ReplicaReport(self.replica_id, await self._status("/health"), (await self._body("/metrics")).decode())

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

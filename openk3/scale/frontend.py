"""The ingress deployment: one OpenAI-compatible endpoint in front of the engine replicas.

Every path but /health and /metrics is forwarded as it came (the replica's own app answers it, errors included); the
prompt's match-unit keys ride along for the router. With a prefill pool (prefill/decode disaggregation), a completion or
chat request first goes to a prefill replica, which computes its prompt but the last token and returns the hand-off
record of that boundary; the request then goes to a decode replica with the record, which imports it and serves the
request from it (replica.py). A prefill that fails (its replica lost, busy, or the prompt refused) is counted and the
request goes to a decode replica without a record, which computes the whole prompt: slower, never a different answer.
With prefix pulls on (`prefix_pull`), a completion or chat call also carries its prompt's ids and cache_salt: the router
may hint that its replica pull a prefix another replica holds, and the replica checks the record against them
(scale/prefix_pull.py).

A prefill call also ends, without its answer, when the prefill pool has no healthy replica left (health_board.py):
Ray would hold it until a replacement replica has started (seconds to minutes), the decode replica computes the prompt
now. While the pool is down, requests skip the prefill at once.

/health is the health board's last probe (health_board.py: every replica probed in the background, each answer bounded
in time), so it answers at once however many replicas are dead: 200 while at least one decode replica is healthy
("status": "ok", or "degraded" when some replica of either pool is not), else 503, with the healthy and unhealthy counts
per pool and each replica's line. /metrics asks every replica (both pools) through the router, by id, for its report,
each bounded by METRICS_TIMEOUT_S (a scrape, not a liveness check: rendering a busy replica's metrics takes time). The
replica ids come from Ray's registry of named actors, where Serve registers each replica as
`SERVE_REPLICA::<app>#<deployment>#<id>`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

import ray
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from ray.exceptions import ActorDiedError, RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from openk3.api.errors import APIError
from openk3.scale.calls import ReplicaCall, ReplicaReport, ResponseHead
from openk3.scale.forward import ForwardStats, rest_of_body, start
from openk3.scale.health_board import HealthBoard, ProbeConfig, until_down
from openk3.scale.metrics_merge import counter, gauge, merged_families, render
from openk3.scale.prompt_keys import PromptKeys

LOST = (RayActorError,)  # a replica's process died or cannot be reached (ActorDiedError, ActorUnavailableError)
HOP_HEADERS = {b"host", b"content-length", b"connection", b"transfer-encoding"}
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
METRICS_TIMEOUT_S = 10.0  # /metrics: a replica that cannot answer its report in this long is left out (and counted unhealthy)
T = TypeVar("T")
log = logging.getLogger("openk3.scale")


def own_request_id(make_call: Callable[[], T]) -> T:
    """Make a replica call outside the current request's context, so Ray gives it an internal request id of its own.

    Ray Serve gives every call made while handling a request that request's internal id, and its router hands the replica
    it chose to the pending call with that id: two calls of one request (the reports of /health, a retry after a lost
    replica) would take each other's replica, and Ray's routing loop then spins without backing off."""
    return contextvars.Context().run(make_call)


def num_healthy(reports: dict[str, ReplicaReport | str]) -> int:
    return sum(isinstance(v, ReplicaReport) and v.health_status == 200 for v in reports.values())


def replica_ids(app_name: str, deployment: str) -> list[str]:
    prefix = f"SERVE_REPLICA::{app_name}#{deployment}#"
    names = ray.util.list_named_actors(all_namespaces=True)
    return sorted(n["name"][len(prefix) :] for n in names if isinstance(n, dict) and n["name"].startswith(prefix))


def actor_id(app_name: str, deployment: str, replica: str) -> str | None:
    """The Ray actor id (hex) of a replica, as Ray's errors name it; None when it is gone already."""
    try:
        return str(ray.get_actor(f"SERVE_REPLICA::{app_name}#{deployment}#{replica}", namespace="serve")._actor_id.hex())
    except ValueError:  # no actor of that name (any more)
        return None


@dataclass
class HandoffStats:
    handoffs: int = 0  # requests sent to a decode replica with a prefill replica's record
    record_bytes: int = 0
    prefill_failures: int = 0  # prefill calls that raised, or were given up (pool down): computed whole on a decode replica
    no_record: int = 0  # prefill calls answered without a record (a one-token prompt, or one the engine refused)


class Frontend:
    def __init__(
        self,
        replicas: DeploymentHandle,
        serve_args: argparse.Namespace,
        app_name: str,
        deployment: str,
        match_unit: int,
        prefill: DeploymentHandle | None = None,
        prefill_deployment: str | None = None,
        probe: ProbeConfig | None = None,
        pool_sizes: tuple[int, int] = (1, 0),
        prefix_pull: bool = False,
    ) -> None:
        """pool_sizes: the decode (or only) pool's replicas and the prefill pool's, as deployed (what /health counts);
        prefix_pull: send each request's prompt ids, so that its replica can pull a prefix (the router hints it)."""
        from openk3.api.chat_loading import load_chat_template
        from openk3.serve.loading import ASSETS, model_tokenizer

        model_dir = Path(serve_args.model) if Path(serve_args.model).is_dir() else ASSETS / str(serve_args.model)
        template = load_chat_template(model_dir if model_dir.is_dir() else None, serve_args.chat_template)
        tokenizer = model_tokenizer(serve_args.model, serve_args.seed, serve_args.tokenizer == "byte")
        name = serve_args.served_model_name or str(serve_args.model)
        self.keys = PromptKeys(tokenizer, template, name, match_unit, serve_args.default_chat_template_kwargs)
        self.replicas = replicas
        self.app_name = app_name
        self.deployment = deployment
        self.prefill, self.prefill_deployment = prefill, prefill_deployment
        self.prefix_pull = prefix_pull
        self.stats = ForwardStats()
        self.handoff = HandoffStats()
        self.probe = probe or ProbeConfig()
        sizes = dict(zip([name for _, name in self._pools()], pool_sizes, strict=False))
        self.board = HealthBoard(sizes, self._list_ids, self._probe_health, self.probe)
        self._probing: asyncio.Task[None] | None = None
        self._actors: dict[str, tuple[str, str]] = {}  # Ray actor id (hex) -> (pool, replica id), learnt by the probes

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="openk3 scale-out front end", docs_url=None, redoc_url=None, openapi_url=None)

        @app.exception_handler(APIError)
        async def _api_error(request: Request, e: APIError) -> JSONResponse:
            return e.response()

        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/{path:path}", self.proxy, methods=["GET", "POST", "DELETE", "OPTIONS"])
        return app

    async def _open(self, call: ReplicaCall) -> AsyncIterator[ResponseHead | bytes]:
        gen = own_request_id(lambda: self.replicas.options(stream=True).forward.remote(call))
        assert isinstance(gen, DeploymentResponseGenerator), "stream=True gives a generator"
        done = False
        try:
            async for item in gen:
                yield item
            done = True
        except LOST as e:
            self._saw_lost(e)
            raise
        finally:
            if not done:
                gen.cancel()  # the client left (or the replica failed): the replica's app sees a disconnect and aborts

    def _ensure_probing(self) -> None:
        """The board's probe loop, started on the serving event loop by the first request (the constructor has none)."""
        if self._probing is None or self._probing.done():
            self._probing = asyncio.get_running_loop().create_task(self.board.run())

    async def _list_ids(self, pool: str) -> list[str]:
        ids = await asyncio.to_thread(replica_ids, self.app_name, pool)
        known = {replica for p, replica in self._actors.values() if p == pool}
        for replica in set(ids) - known:
            actor = await asyncio.to_thread(actor_id, self.app_name, pool, replica)
            if actor is not None:
                self._actors[actor] = (pool, replica)
        return ids

    def _saw_lost(self, e: BaseException) -> None:
        """A replica call raised Ray's "actor lost": a dead replica is marked on the board now; any loss wakes the probes."""
        where = self._actors.get(getattr(e, "actor_id", None) or "")
        if isinstance(e, ActorDiedError) and where is not None:
            self.board.mark_lost(*where, type(e).__name__)
        else:
            self.board.wake()

    async def _probe_health(self, pool: str, replica: str) -> int:
        handle = dict((name, h) for h, name in self._pools())[pool]
        report: ReplicaReport = await own_request_id(lambda: handle.report.remote(ReplicaCall("GET", "/health", target=replica)))
        return report.health_status

    async def proxy(self, request: Request) -> Response:
        self._ensure_probing()
        body = await request.body()
        path = request.url.path
        keys, handoff, pull = await asyncio.to_thread(self._prompt, request.method, path, body)  # tokenising is CPU work: off the event loop
        request_id = uuid.uuid4().hex
        record = None
        if handoff is not None:
            record = await self._prefill(ReplicaCall("POST", path, keys=keys, request_id=request_id, prompt_ids=tuple(handoff)))
        headers = tuple((k, v) for k, v in request.headers.raw if k.lower() not in HOP_HEADERS)
        call = ReplicaCall(request.method, path, request.url.query.encode(), headers, body, keys, request_id, record=record)
        if pull is not None:
            call = replace(call, prompt_ids=tuple(pull[0]), cache_salt=pull[1])
        started = await start(self._open, call, LOST, self.stats)
        response = StreamingResponse(rest_of_body(started, LOST, self.stats), status_code=started.head.status)
        response.raw_headers = [(k.lower(), v) for k, v in started.head.headers if k.lower() not in HOP_HEADERS]
        return response

    def _prompt(self, method: str, path: str, body: bytes) -> tuple[tuple[bytes, ...], list[int] | None, tuple[list[int], str | None] | None]:
        """The prompt's routing keys (under its cache_salt); with a prefill pool the ids a prefill replica computes (None:
        no hand-off); with prefix pulls the ids and cache_salt a pulled prefix is checked against (None: no pull)."""
        ids = self.keys.prompt_ids(path, body)
        salt = self.keys.cache_salt(path, body)
        handoff = self.keys.handoff_ids(path, body, ids) if self.prefill is not None and method == "POST" else None
        exact = self.keys.exact_ids(path, body, ids) if self.prefix_pull and method == "POST" else None
        return self.keys.keys_of(ids, salt), handoff, None if exact is None else (exact, salt)

    async def _prefill(self, call: ReplicaCall) -> bytes | None:
        prefill, pool = self.prefill, self.prefill_deployment
        assert prefill is not None and pool is not None
        if self.board.is_down(pool):
            self.handoff.prefill_failures += 1
            return None
        try:
            response = own_request_id(lambda: prefill.prefill.remote(call))
            record: bytes | None = await until_down(self.board, pool, response, response.cancel)
        except Exception as e:  # the request is still served, by a decode replica alone
            if isinstance(e, LOST):
                self._saw_lost(e)
            self.handoff.prefill_failures += 1
            log.warning("request %s: prefill failed (%s: %s), its decode replica computes the prompt", call.request_id, type(e).__name__, e)
            return None
        if record is None:
            self.handoff.no_record += 1
        else:
            self.handoff.handoffs += 1
            self.handoff.record_bytes += len(record)
        return record

    def _pools(self) -> list[tuple[DeploymentHandle, str]]:
        pools = [(self.replicas, self.deployment)]
        if self.prefill is not None and self.prefill_deployment is not None:
            pools.append((self.prefill, self.prefill_deployment))
        return pools

    async def _reports(self) -> dict[str, ReplicaReport | str]:
        """Every replica's report (its /health status and /metrics text), each bounded by METRICS_TIMEOUT_S."""

        async def one(handle: DeploymentHandle, replica: str) -> ReplicaReport | str:
            try:
                call = ReplicaCall("GET", "/report", target=replica)
                return await asyncio.wait_for(own_request_id(lambda: handle.report.remote(call)), METRICS_TIMEOUT_S)
            except Exception as e:  # one replica's failure is its line in the report, never the front end's error
                return f"{type(e).__name__}: {e}".splitlines()[0]

        found = [(handle, r) for handle, name in self._pools() for r in await asyncio.to_thread(replica_ids, self.app_name, name)]
        results = await asyncio.gather(*(one(handle, r) for handle, r in found))
        return dict(zip((r for _, r in found), results, strict=True))

    async def health(self) -> JSONResponse:
        self._ensure_probing()
        if self.board.probed_at is None:  # the first probe, itself bounded: its listing and each answer by the timeout
            await self.board.wait_probed()
        body = self.board.summary()
        serving = self.board.healthy(self.deployment) > 0
        body["status"] = ("ok" if body["unhealthy"] == 0 else "degraded") if serving else "unavailable"
        return JSONResponse(body, status_code=200 if serving else 503)

    async def metrics(self) -> Response:
        reports = await self._reports()
        texts = {r: v.metrics_text for r, v in reports.items() if isinstance(v, ReplicaReport)}
        healthy = num_healthy(reports)
        families = merged_families(texts)
        states: dict[tuple[tuple[str, str], ...], float] = {(("state", "healthy"),): float(healthy), (("state", "unhealthy"),): float(len(reports) - healthy)}
        families.append(gauge("openk3:scale_replicas", "engine replicas by their last report", states))
        families.append(counter("openk3:scale_retries", "requests retried once: their replica was lost before answering", self.stats.retries))
        families.append(counter("openk3:scale_failed_before_send", "requests answered 503: replica lost twice before answering", self.stats.failed_before_send))
        families.append(counter("openk3:scale_failed_mid_stream", "requests cut by a replica lost mid-answer", self.stats.failed_mid_stream))
        if self.prefill is not None:
            h = self.handoff
            families.append(counter("openk3:scale_handoffs", "requests a decode replica served from a prefill replica's record", h.handoffs))
            families.append(counter("openk3:scale_handoff_bytes", "bytes of the hand-off records sent to decode replicas", h.record_bytes))
            families.append(counter("openk3:scale_prefill_failures", "prefill calls that failed: the decode replica computed the prompt", h.prefill_failures))
            families.append(counter("openk3:scale_prefill_no_record", "prefill calls that returned no record (prompt too short or refused)", h.no_record))
        return Response(render(families), media_type=METRICS_CONTENT_TYPE)

"""The ingress deployment: one OpenAI-compatible endpoint in front of the engine replicas.

Every path but /health and /metrics is forwarded as it came (the replica's own app answers it, errors included); the
prompt's match-unit keys ride along for the router. With a prefill pool (prefill/decode disaggregation), a completion or
chat request first goes to a prefill replica, which computes its prompt but the last token and returns the hand-off
record of that boundary; the request then goes to a decode replica with the record, which imports it and serves the
request from it (replica.py). A prefill that fails (its replica lost, busy, or the prompt refused) is counted and the
request goes to a decode replica without a record, which computes the whole prompt: slower, never a different answer.

/health and /metrics are the replicas' own (both pools'), aggregated: each replica is asked through the router, by id,
for its report. /health is 200 while at least one replica is healthy (its body lists each one), else 503. The replica
ids come from Ray's registry of named actors, where Serve registers each replica as `SERVE_REPLICA::<app>#<deployment>#<id>`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import ray
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from openk3.api.errors import APIError
from openk3.scale.calls import ReplicaCall, ReplicaReport, ResponseHead
from openk3.scale.forward import ForwardStats, rest_of_body, start
from openk3.scale.metrics_merge import counter, gauge, merged_families, render
from openk3.scale.prompt_keys import PromptKeys

LOST = (RayActorError,)  # a replica's process died or cannot be reached (ActorDiedError, ActorUnavailableError)
REPORT_TIMEOUT_S = 10.0  # a replica that cannot answer its report in this long counts as unhealthy
HOP_HEADERS = {b"host", b"content-length", b"connection", b"transfer-encoding"}
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
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


@dataclass
class HandoffStats:
    handoffs: int = 0  # requests sent to a decode replica with a prefill replica's record
    record_bytes: int = 0
    prefill_failures: int = 0  # prefill calls that raised: those requests were computed whole on a decode replica
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
    ) -> None:
        from openk3.api.chat_loading import load_chat_template
        from openk3.serve.loading import ASSETS, model_tokenizer

        model_dir = Path(serve_args.model) if Path(serve_args.model).is_dir() else ASSETS / str(serve_args.model)
        template = load_chat_template(model_dir if model_dir.is_dir() else None, serve_args.chat_template)
        tokenizer = model_tokenizer(serve_args.model, serve_args.seed, serve_args.tokenizer == "byte")
        self.keys = PromptKeys(tokenizer, template, serve_args.served_model_name or str(serve_args.model), match_unit)
        self.replicas = replicas
        self.app_name = app_name
        self.deployment = deployment
        self.prefill, self.prefill_deployment = prefill, prefill_deployment
        self.stats = ForwardStats()
        self.handoff = HandoffStats()

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
        finally:
            if not done:
                gen.cancel()  # the client left (or the replica failed): the replica's app sees a disconnect and aborts

    async def proxy(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        keys, handoff = await asyncio.to_thread(self._prompt, request.method, path, body)  # tokenising is CPU work: off the event loop
        request_id = uuid.uuid4().hex
        record = None
        if handoff is not None:
            record = await self._prefill(ReplicaCall("POST", path, keys=keys, request_id=request_id, prompt_ids=tuple(handoff)))
        headers = tuple((k, v) for k, v in request.headers.raw if k.lower() not in HOP_HEADERS)
        call = ReplicaCall(request.method, path, request.url.query.encode(), headers, body, keys, request_id, record=record)
        started = await start(self._open, call, LOST, self.stats)
        response = StreamingResponse(rest_of_body(started, LOST, self.stats), status_code=started.head.status)
        response.raw_headers = [(k.lower(), v) for k, v in started.head.headers if k.lower() not in HOP_HEADERS]
        return response

    def _prompt(self, method: str, path: str, body: bytes) -> tuple[tuple[bytes, ...], list[int] | None]:
        """The prompt's routing keys (under its cache_salt), and with a prefill pool the ids a prefill replica computes
        (None: no hand-off)."""
        ids = self.keys.prompt_ids(path, body)
        handoff = self.keys.handoff_ids(path, body, ids) if self.prefill is not None and method == "POST" else None
        return self.keys.keys_of(ids, self.keys.cache_salt(path, body)), handoff

    async def _prefill(self, call: ReplicaCall) -> bytes | None:
        assert self.prefill is not None
        try:
            record: bytes | None = await own_request_id(lambda: self.prefill.prefill.remote(call))  # type: ignore[union-attr]
        except Exception as e:  # the request is still served, by a decode replica alone
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
        async def one(handle: DeploymentHandle, replica: str) -> ReplicaReport | str:
            try:
                call = ReplicaCall("GET", "/report", target=replica)
                return await asyncio.wait_for(own_request_id(lambda: handle.report.remote(call)), REPORT_TIMEOUT_S)
            except Exception as e:  # one replica's failure is its line in the report, never the front end's error
                return f"{type(e).__name__}: {e}".splitlines()[0]

        found = [(handle, r) for handle, name in self._pools() for r in await asyncio.to_thread(replica_ids, self.app_name, name)]
        results = await asyncio.gather(*(one(handle, r) for handle, r in found))
        return dict(zip((r for _, r in found), results, strict=True))

    async def health(self) -> JSONResponse:
        reports = await self._reports()
        lines = {r: (f"health {v.health_status}" if isinstance(v, ReplicaReport) else v) for r, v in reports.items()}
        healthy = num_healthy(reports)
        body = {"healthy": healthy, "replicas": lines}
        return JSONResponse(body, status_code=200 if healthy else 503)

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

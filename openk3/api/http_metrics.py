"""HTTP request metrics, named as prometheus-fastapi-instrumentator names them (what vLLM's server exports beside its
`vllm:` families): `http_requests_total{handler, method, status}` and `http_request_duration_seconds{handler, method}`.

Every label has a bounded set of values whatever a client sends, so a hostile client cannot grow the registry: `handler` is
the matched route's template (`/v1/responses/{response_id}`, never the raw path), `none` for a path no route has; `method`
is one of the standard methods or `other`; `status` is the class (`2xx`, `4xx`, ...), as the instrumentator groups it. The
duration runs from the request's arrival to the last byte of its answer (a stream's whole life). `/metrics` and `/health`
are not counted (scrapes and probes, as vLLM leaves them out).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"})
UNCOUNTED = frozenset({"/metrics", "/health"})
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class HTTPMetrics:
    """The two families, in the server's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("http_requests", "HTTP requests by route template, method and status class", ("handler", "method", "status"), registry=registry)
        self.duration = Histogram(
            "http_request_duration_seconds", "Arrival to the last byte of the answer", ("handler", "method"), buckets=DURATION_BUCKETS, registry=registry
        )

    def observe(self, handler: str, method: str, status: int, seconds: float) -> None:
        self.requests.labels(handler=handler, method=method, status=f"{status // 100}xx").inc()
        self.duration.labels(handler=handler, method=method).observe(seconds)


def route_template(scope: dict) -> str:
    """The template of the route that served (or, for a wrong method, has) this path, which Starlette's routing writes into
    the request's scope; `none` when no route has it."""
    path = getattr(scope.get("route"), "path", None)
    return path if isinstance(path, str) else "none"


class HTTPMetricsMiddleware:
    """Pure ASGI (a streamed answer passes through untouched); `clock` is a parameter so tests need no sleeping."""

    def __init__(self, app: Any, metrics: HTTPMetrics, clock: Callable[[], float] = time.perf_counter) -> None:
        self.app = app
        self.metrics = metrics
        self.clock = clock

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("path") in UNCOUNTED:
            await self.app(scope, receive, send)
            return
        start = self.clock()
        method = scope.get("method", "")
        method = method if method in METHODS else "other"
        status = 500  # an app that raises before it answers: the server's error handler answers 500
        recorded = False

        def record() -> None:
            nonlocal recorded
            if not recorded:
                recorded = True
                self.metrics.observe(route_template(scope), method, status, self.clock() - start)

        async def watch(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                record()

        try:
            await self.app(scope, receive, watch)
        finally:
            record()

"""The OpenAI-compatible HTTP server: the FastAPI app over the AsyncEngine front end, built from the routers in api/routes/.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET and DELETE /v1/responses/{id}, GET
/v1/responses/{id}/input_items, GET /v1/models, GET /v1/models/{id} (these need `Authorization: Bearer <key>` when the
server has an API key, as vLLM checks /v1 only), GET /health, GET /metrics (Prometheus text: the engine's families,
api/metrics.py, and HTTP requests by route and status, api/http_metrics.py), GET /tokenizer_info, GET /version, POST
/tokenize, POST /detokenize, the RL weight routes (routes/weights.py: /update_weights_from_disk, the weight group's
three, /get_weight_version), and for sglang-router (routes/router_info.py, routes/health_generate.py): GET /server_info,
GET /model_info (also as /get_server_info, /get_model_info) and GET /health_generate (a 1-token generation); POST bodies
must be `application/json` (415), CORS only for --allowed-origins.
Every error is an OpenAI error body; a handler never lets a client's mistake become a 5xx.
A client that disconnects aborts its request: streaming responses race the stream against ASGI `http.disconnect`, and
non-streaming handlers race the generation against it, so the engine frees the request's pages and state slot at once.
The app's lifespan starts the engine thread and, on shutdown, drains in-flight requests, then aborts what is left.
This module owns what is app-wide (state, lifespan, error handlers); the routes reach the state through routes/state.py.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from openk3.api.chat_loading import ChatRenderer
from openk3.api.connection import ConnectionConfig
from openk3.api.errors import APIError, ClientGone, frontend_error
from openk3.api.http_metrics import HTTPMetrics, HTTPMetricsMiddleware
from openk3.api.idle import IdleCallback
from openk3.api.images import media_support
from openk3.api.metrics import ServerMetrics
from openk3.api.prompt_text import PromptEncoder
from openk3.api.request_id import RequestIdHeader, request_id_of
from openk3.api.responses_store import ResponseStore
from openk3.api.routes import completions, health, health_generate, models, responses_api, router_info, tokens, weights
from openk3.api.routes.state import ServerConfig, ServerState
from openk3.api.served_model import ServedModel
from openk3.api.token_texts import TokenTexts
from openk3.serve.admission import QueueFullError, QueueTimeoutError
from openk3.serve.async_engine import AsyncEngine, EngineDeadError, EngineStalledError, FrontendClosedError
from openk3.serve.engine_api import ServedEngine
from openk3.serve.heap_trim import HeapTrimmer
from openk3.serve.tokenizer import Tokenizer

__all__ = ["ServerConfig", "create_app"]  # ServerConfig lives in routes/state.py (the routes read it); callers import it here

log = logging.getLogger("openk3.api")


def create_app(engine: ServedEngine, tokenizer: Tokenizer, chat_template: ChatRenderer, config: ServerConfig) -> FastAPI:
    metrics = ServerMetrics(config.model.name, config.metrics_prefix)
    frontend = AsyncEngine(engine, observer=metrics, config=config.frontend)
    chat_stop, chat_stop_token_ids = chat_template.stops(tokenizer)
    chat_template.check_kwargs(config.default_chat_template_kwargs)  # a default the renderer does not read fails at start-up
    served = ServedModel(
        frontend=frontend,
        tokenizer=tokenizer,
        chat_template=chat_template,
        model=config.model,
        max_model_len=engine.max_model_len,
        vocab_size=min(engine.model_config.vocab_size, max(tokenizer.vocab_size, 1)),
        texts=TokenTexts(tokenizer),
        encoder=PromptEncoder(tokenizer, engine.max_model_len),
        limits=config.limits,
        chat_stop=chat_stop,
        chat_stop_token_ids=chat_stop_token_ids,
        default_chat_kwargs=dict(config.default_chat_template_kwargs),
        media=media_support(engine.vision, tokenizer, chat_template, config.media, config.media_fetch),
    )

    trimmer = HeapTrimmer(config.heap_trim_slack_bytes) if config.heap_trim_slack_bytes is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics.observe_engine(engine)  # before the engine thread starts, so no other thread reads it
        frontend.start()
        if trimmer is not None:
            trimmer.start()
        yield
        await frontend.shutdown(config.shutdown_timeout_s)
        served.encoder.close()
        if frontend.error is not None:
            log.error("the engine ended in error: %r", frontend.error)

    app = FastAPI(title="openk3", version=health.package_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = ServerState(config, served, metrics)
    app.state.served = served  # by these two names for the CLI (EP metrics) and the tests (the front end)
    app.state.metrics = metrics
    app.state.response_store = ResponseStore(config.response_store_size)  # previous_response_id (routes/responses_api.py)
    _install_error_handlers(app)
    _install_cors(app, config.connection)
    app.state.weight_groups = {}  # the trainers' weight groups this server has joined, by name (routes/weights.py)
    for module in (health, health_generate, router_info, models, completions, responses_api, tokens, weights):
        app.include_router(module.router)
    if trimmer is not None:
        app.add_middleware(IdleCallback, on_idle=trimmer.on_idle)
        app.state.heap_trimmer = trimmer
    app.add_middleware(HTTPMetricsMiddleware, metrics=HTTPMetrics(metrics.registry))
    app.add_middleware(RequestIdHeader)  # outermost: every answer carries it, errors and CORS preflights included
    return app


def _install_cors(app: FastAPI, connection: ConnectionConfig) -> None:
    """Browsers may call the API from the allowed origins only (none by default: no CORS headers at all, so a page on
    another origin can neither read answers nor send the preflighted JSON POSTs; api/errors.py refuses other bodies)."""
    origins = connection.origins
    if not origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(origins),
        allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
        allow_headers=["Authorization", "Content-Type"],
        allow_credentials=False,  # the API key travels in a header the page sets, never in cookies
        max_age=600,
    )


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # the routing's own headers stay: a 405 names the methods the path has in `Allow`
        message = f"{request.method} {request.url.path}: {e.detail}"
        return APIError(e.status_code, message, code=str(e.status_code), headers=dict(e.headers or {})).response()

    @app.exception_handler(ClientGone)
    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, e: Exception) -> Response:
        # nobody reads the answer; what happened is worth one line, not a traceback
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        what = e if isinstance(e, ClientGone) else f"client left during {request.method} {request.url.path}"
        log.info("%s (request %s): %s", client, request_id_of(request.scope), what)
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return APIError(400, str(e.errors()[:3]), code="invalid_value").response()

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, e: ValueError) -> JSONResponse:
        return APIError(400, str(e), code="invalid_value").response()

    @app.exception_handler(FrontendClosedError)
    @app.exception_handler(EngineDeadError)
    @app.exception_handler(EngineStalledError)
    @app.exception_handler(QueueFullError)
    @app.exception_handler(QueueTimeoutError)
    async def _unavailable(request: Request, e: Exception) -> JSONResponse:
        error = frontend_error(e)
        assert error is not None, "registered for the front end's errors only"
        return error.response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s (request %s)", request.method, request.url.path, request_id_of(request.scope), exc_info=e)
        return APIError(500, f"internal server error: {type(e).__name__}", code="internal_error").response()

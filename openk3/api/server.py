"""The OpenAI-compatible HTTP server: FastAPI routes over the AsyncEngine front end.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models (these three need `Authorization: Bearer <key>` when
the server has an API key, as vLLM checks /v1 only), GET /health, GET /metrics (Prometheus text), GET /version,
POST /tokenize, POST /detokenize. Every error is an OpenAI error body; a handler never lets a client's mistake become a 5xx.
A client that disconnects aborts its request: streaming responses race the stream against ASGI `http.disconnect`, and
non-streaming handlers race the generation against it, so the engine frees the request's pages and state slot at once.
The app's lifespan starts the engine thread and, on shutdown, drains in-flight requests, then aborts what is left.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from importlib import metadata
from typing import TypeVar

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from openk3.api.chat import ChatTemplate
from openk3.api.errors import APIError, read_json
from openk3.api.generation import TokenTexts
from openk3.api.metrics import CONTENT_TYPE, ServerMetrics
from openk3.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ModelCard, ModelList, TokenizeRequest
from openk3.api.serving import Served, chat_job, chat_response, chat_stream, completion_jobs, completion_response, completion_stream
from openk3.serve.engine import LLMEngine
from openk3.serve.frontend import AsyncEngine, EngineDeadError, FrontendClosedError
from openk3.serve.tokenizer import Tokenizer

log = logging.getLogger("openk3.api")
T = TypeVar("T")


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    model_root: str
    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20  # a 10 MB body is refused with 413 before it is read
    stop_token_ids: tuple[int, ...] = ()  # the checkpoint's end tokens (generation_config.json)
    shutdown_timeout_s: float = 30.0


class EventStreamResponse(StreamingResponse):
    """SSE that stops (and aborts its request) as soon as the client disconnects, not at the next failed send."""

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        streamer, watcher = asyncio.ensure_future(self.stream_response(send)), asyncio.ensure_future(watch())
        try:
            await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streamer, watcher):
                task.cancel()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """work's result, or None when the client went away first (work is then cancelled, which aborts its engine requests)."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    worker, watcher = asyncio.ensure_future(work), asyncio.ensure_future(watch())
    try:
        await asyncio.wait({worker, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (worker, watcher):
            if not task.done():
                task.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if worker.cancelled() or not worker.done():
        await asyncio.gather(worker, return_exceptions=True)
        return None
    return worker.result()


def _version() -> str:
    try:
        return metadata.version("openk3")
    except metadata.PackageNotFoundError:
        return "unknown (openk3 is not installed as a package)"


def create_app(engine: LLMEngine, tokenizer: Tokenizer, chat_template: ChatTemplate, config: ServerConfig) -> FastAPI:
    metrics = ServerMetrics(config.model_name)
    frontend = AsyncEngine(engine, observer=metrics)
    chat_stop, chat_stop_token_ids = chat_template.stops(tokenizer)
    served = Served(
        frontend=frontend,
        tokenizer=tokenizer,
        chat_template=chat_template,
        model_name=config.model_name,
        model_root=config.model_root,
        max_model_len=engine.max_model_len,
        vocab_size=min(engine.model_config.vocab_size, max(tokenizer.vocab_size, 1)),
        texts=TokenTexts(tokenizer),
        stop_token_ids=config.stop_token_ids,
        chat_stop=chat_stop,
        chat_stop_token_ids=chat_stop_token_ids,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics.observe_engine(engine)  # before the engine thread starts, so no other thread reads it
        frontend.start()
        yield
        await frontend.shutdown(config.shutdown_timeout_s)
        if frontend.error is not None:
            log.error("the engine ended in error: %r", frontend.error)

    app = FastAPI(title="openk3", version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.served = served
    app.state.metrics = metrics
    limit = config.max_body_bytes

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}", code=str(e.status_code)).response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return APIError(400, str(e.errors()[:3]), code="invalid_value").response()

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, e: ValueError) -> JSONResponse:
        return APIError(400, str(e), code="invalid_value").response()

    @app.exception_handler(FrontendClosedError)
    @app.exception_handler(EngineDeadError)
    async def _unavailable(request: Request, e: Exception) -> JSONResponse:
        return APIError(503, str(e), code="unavailable").response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=e)
        return APIError(500, f"internal server error: {type(e).__name__}", code="internal_error").response()

    def authorize(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), config.api_key.encode()):
            raise APIError(401, "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != config.model_name:
            raise APIError(404, f"The model `{name}` does not exist. This server serves `{config.model_name}`.", param="model", code="model_not_found")

    def check_open() -> None:
        if not frontend.is_healthy:
            raise APIError(503, "the engine is not running" if frontend.error is None else f"the engine failed: {frontend.error!r}", code="unavailable")

    @app.get("/health")
    async def health() -> Response:
        check_open()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": _version()}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        card = ModelCard(id=config.model_name, root=config.model_root, max_model_len=served.max_model_len)
        return Response(ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        authorize(request)
        req = await read_json(request, CompletionRequest, limit)
        check_model(req.model)
        jobs, texts = completion_jobs(served, req)
        check_open()
        if req.stream:
            return EventStreamResponse(completion_stream(served, req, jobs, texts))
        result = await until_disconnect(request, completion_response(served, req, jobs, texts))
        return Response(status_code=499) if result is None else Response(result.model_dump_json(), media_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        authorize(request)
        req = await read_json(request, ChatCompletionRequest, limit)
        check_model(req.model)
        job = chat_job(served, req)
        check_open()
        if req.stream:
            return EventStreamResponse(chat_stream(served, req, job))
        result = await until_disconnect(request, chat_response(served, req, job))
        return Response(status_code=499) if result is None else Response(result.model_dump_json(), media_type="application/json")

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = await read_json(request, TokenizeRequest, limit)
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "send exactly one of prompt or messages", param="prompt", code="invalid_value")
        if req.messages is not None:
            text, special = served.render_chat(req.messages), False
        else:
            text, special = req.prompt or "", True
        ids = tokenizer.encode(text, add_special_tokens=special if req.add_special_tokens is None else req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": served.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = await read_json(request, DetokenizeRequest, limit)
        check_model(req.model)
        bad = next((t for t in req.tokens if t >= tokenizer.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"tokens has id {bad}: expected ids in 0..{tokenizer.vocab_size - 1}", param="tokens", code="invalid_value")
        return {"prompt": tokenizer.decode(req.tokens)}

    return app

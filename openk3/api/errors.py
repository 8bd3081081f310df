"""OpenAI error bodies, and reading a request body into a validated model without ever answering a bad body with a 5xx.

Every error a client can cause is an `APIError` with the HTTP status, OpenAI's `type`, the offending `param` and a `code`;
the server turns it into `{"error": {"message", "type", "param", "code"}}`. The body is read by hand (not by FastAPI's
automatic validation, which answers 422 with another shape) so that size, UTF-8, JSON and schema problems each get their
own 4xx and message.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from openk3.api.responses import ErrorInfo, ErrorResponse

log = logging.getLogger("openk3.api")
M = TypeVar("M", bound=BaseModel)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)).model_dump()

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


_PARAM = re.compile(r"SamplingParams\.(\w+)=")


def from_value_error(e: ValueError, param: str | None = None) -> APIError:
    """A ValueError from the engine or SamplingParams (bad user input) as a 400 naming the field when the message does."""
    match = _PARAM.search(str(e))
    return APIError(400, str(e), param=match.group(1) if match else param, code="invalid_value")


def _describe(err: ValidationError) -> tuple[str, str | None]:
    parts, first = [], None
    for item in err.errors()[:5]:
        loc = ".".join(str(x) for x in item["loc"])
        first = first or loc.split(".")[0] or None
        value = repr(item.get("input"))
        value = value if len(value) <= 60 else value[:57] + "..."
        parts.append(f"{loc or 'body'}: {item['msg']} (got {value})")
    more = len(err.errors()) - 5
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else ""), first


class ClientGone(Exception):
    """The client closed its connection before its request body was complete: nobody to answer, one INFO line to log."""


def check_json_content_type(request: Request) -> None:
    """A 415 unless the body is declared `application/json` (a charset parameter may only say UTF-8). A web page can POST
    form data or text/plain to any address without a CORS preflight, but not JSON, so this keeps pages off a local server."""
    header = request.headers.get("content-type")
    media, *params = [part.strip().lower() for part in (header or "").split(";")]
    charsets = [value.strip('" ') for name, _, value in (p.partition("=") for p in params) if name.strip() == "charset"]
    if media != "application/json" or any(c not in ("utf-8", "utf8") for c in charsets):
        got = "no Content-Type" if header is None else f"Content-Type {header[:100]!r}"
        raise APIError(415, f"request body must be JSON sent as 'Content-Type: application/json', got {got}", code="unsupported_media_type")


async def read_body(request: Request, limit: int, timeout_s: float | None = None) -> bytes:
    """The whole body, at most `limit` bytes (413) and within `timeout_s` seconds of the first read (408)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {int(length)} bytes is larger than the limit of {limit} bytes", code="request_too_large")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise APIError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")
    except TimeoutError as e:
        message = f"the request body was not received within {timeout_s:g} s ({len(body)} bytes arrived; openk3 serve --body-read-timeout-s)"
        raise APIError(408, message, code="request_timeout", headers={"Connection": "close"}) from e
    except ClientDisconnect as e:
        expected = f" of {int(length)}" if length is not None and length.isdigit() else ""
        raise ClientGone(f"client left during the request body of {request.method} {request.url.path} ({len(body)}{expected} bytes received)") from e
    return bytes(body)


async def read_json(request: Request, model: type[M], limit: int, timeout_s: float | None = None) -> M:
    check_json_content_type(request)
    body = await read_body(request, limit, timeout_s)
    if len(body) <= PARSE_ON_LOOP_BYTES:
        parsed = _parse(body, model)
    else:  # parsing and validating a multi-MB body takes tens of ms: off the event loop, so other streams keep flowing
        parsed = await asyncio.get_running_loop().run_in_executor(None, _parse, body, model)
    unknown = sorted(getattr(parsed, "model_extra", None) or {})
    if unknown:
        log.info("ignoring unknown fields in %s %s: %s", request.method, request.url.path, ", ".join(unknown))
    return parsed


PARSE_ON_LOOP_BYTES = 64 * 1024


def _parse(body: bytes, model: type[M]) -> M:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8: byte 0x{body[e.start]:02x} at offset {e.start}", code="invalid_encoding") from e
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}", code="invalid_json") from e
    except (ValueError, RecursionError) as e:  # integers past Python's digit limit; nesting deeper than the parser's stack
        raise APIError(400, f"request body is not acceptable JSON: {type(e).__name__}: {str(e)[:200]}", code="invalid_json") from e
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:  # JSON escapes can spell lone surrogates, which no tokenizer can encode
        raise APIError(
            400, f"request body contains an unpaired surrogate escape ({e.object[e.start : e.end]!a}): text must be valid Unicode", code="invalid_encoding"
        ) from e
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = _describe(e)
        raise APIError(400, message, param=param, code="invalid_value") from e


# The queue moves at the engine's step rate, so a refused client may come back soon; one second keeps retries from spinning.
RETRY_AFTER_S = 1
# A dead engine's process exits and its supervisor (torchrun, Kubernetes, Ray) starts a new one, which takes seconds at
# least; a client behind a router is sent to another replica at once whatever this says.
RESTART_RETRY_AFTER_S = 5


def frontend_error(e: BaseException) -> APIError | None:
    """The front end's refusals as 503s, each with Retry-After; None for any other error."""
    from openk3.serve.admission import QueueFullError, QueueTimeoutError
    from openk3.serve.async_engine import EngineDeadError, EngineStalledError, FrontendClosedError

    retry = {"Retry-After": str(RETRY_AFTER_S)}
    if isinstance(e, QueueFullError):
        return APIError(503, f"the server is overloaded: {e}", code="queue_full", headers=retry)
    if isinstance(e, QueueTimeoutError):
        return APIError(503, f"the server is overloaded: {e}", code="queue_timeout", headers=retry)
    if isinstance(e, EngineStalledError):
        return APIError(503, str(e), code="engine_stalled", headers=retry)
    if isinstance(e, (EngineDeadError, FrontendClosedError)):
        return APIError(503, str(e), code="unavailable", headers={"Retry-After": str(RESTART_RETRY_AFTER_S)})
    return None

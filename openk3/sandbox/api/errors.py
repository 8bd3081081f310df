"""How the HTTP server reports errors: a JSON body `{"error": {"type", "message"}}` with the error's status, or the same
record inside a stream that already started (an archive's error frame, an exec_stream line); the clients raise the type."""

from __future__ import annotations

import json
import logging
from typing import Any

import pydantic
from fastapi.responses import JSONResponse

from openk3.sandbox.protocol import ERRORS_BY_NAME, FRAME_ERROR, InvalidArgument, SandboxError, frame

logger = logging.getLogger(__name__)


def type_name(exc: SandboxError) -> str:
    """The nearest error type the clients know (ArchiveRefused travels as InvalidArgument)."""
    return next(c.__name__ for c in type(exc).__mro__ if c.__name__ in ERRORS_BY_NAME)


def record(method: str, exc: Exception) -> dict[str, Any]:
    """{"type", "message"} for an error raised after the answer started; anything but a SandboxError is logged as a bug."""
    if not isinstance(exc, SandboxError):
        logger.error("sandbox %s failed mid-stream", method, exc_info=exc)
        exc = SandboxError(f"{method}: internal error: {type(exc).__name__}: {exc}")
    return {"type": type_name(exc), "message": str(exc)}


def error_frame(method: str, exc: Exception) -> bytes:
    return frame(FRAME_ERROR, json.dumps(record(method, exc)).encode())


def response(exc: SandboxError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content={"error": {"type": type_name(exc), "message": str(exc)}})


def invalid(method: str, e: pydantic.ValidationError) -> JSONResponse:
    fields = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
    return response(InvalidArgument(f"{method}: {fields}"))

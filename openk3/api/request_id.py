"""X-Request-Id, as operators expect of vLLM and most proxies: the client's header is echoed on the response, or one is made
(32 hex digits) when it sent none, and the request's error and disconnect log lines name it."""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable, MutableMapping
from typing import Any

HEADER = b"x-request-id"
# what is echoed: a header is the client's text, so anything that could split or spoof a log line is replaced by a fresh id
SAFE = re.compile(rb"^[A-Za-z0-9._:\-]{1,128}$")
log = logging.getLogger("openk3.api")


def request_id_of(scope: MutableMapping[str, Any]) -> str | None:
    """The id the middleware gave this request (None outside it)."""
    return scope.get("state", {}).get("request_id")


class RequestIdHeader:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = next((v for k, v in scope.get("headers", ()) if k == HEADER), None)
        value = sent if sent is not None and SAFE.match(sent) else uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = value.decode()

        async def with_header(message: dict) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, value)]}
            await send(message)

        await self.app(scope, receive, with_header)

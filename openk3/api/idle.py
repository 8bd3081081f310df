"""An ASGI middleware that counts the HTTP requests in flight and calls back whenever the last one ends (its response,
streamed or not, fully sent or abandoned): the moment the server is idle, which serve/heap_trim.py waits for."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class IdleCallback:
    def __init__(self, app: Any, on_idle: Callable[[], object]) -> None:
        self.app = app
        self.on_idle = on_idle  # run on the default executor: it may block (a heap trim), the event loop must not
        self.in_flight = 0

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                asyncio.get_running_loop().run_in_executor(None, self.on_idle)

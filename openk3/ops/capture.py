"""Whether the ops are being captured into a graph (serve/graphs.py): a capture records the kernels a forward launches and
replays them with the same shapes and addresses, so nothing in the captured forward may read a value back to the host or
size a tensor by one. The "sized" routed-expert dispatch (ops/moe/__init__.py) reads this to take its fixed-shape form.

A context variable, not a global flag: the capture runs on the engine's thread, and nothing else sees it.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

_capturing: contextvars.ContextVar[bool] = contextvars.ContextVar("openk3_graph_capture", default=False)


def capturing() -> bool:
    return _capturing.get()


@contextlib.contextmanager
def graph_capture() -> Iterator[None]:
    token = _capturing.set(True)
    try:
        yield
    finally:
        _capturing.reset(token)

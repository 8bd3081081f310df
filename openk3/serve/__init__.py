"""The serving engine: requests, sampling, the token-budget scheduler over the hybrid cache, the runner.

Names resolve lazily: `openk3.serve.cache.spec` (byte sizes shared with the torch-free planner) must import without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "EngineConfig": "openk3.serve.engine",
    "LLMEngine": "openk3.serve.engine",
    "CompletionOutput": "openk3.serve.output",
    "RequestOutput": "openk3.serve.output",
    "OutputProcessor": "openk3.serve.output",
    "SamplingParams": "openk3.serve.sampling",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'openk3.serve' has no attribute {name!r}")


__all__ = sorted(_LAZY)

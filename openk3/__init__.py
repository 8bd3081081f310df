"""openk3: an open, runnable implementation of the Kimi K3 system.

`from openk3 import LLM, SamplingParams` is the offline entry point. The names resolve lazily, so that the torch-free leaves
(`openk3.planner`, `openk3.sandbox`) can be imported without loading torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {"LLM": "openk3.llm", "SamplingParams": "openk3.serve.sampling"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'openk3' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "__version__"]

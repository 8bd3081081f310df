"""Everything that runs on more than one rank, over torch.distributed (docs/parallel.md):

- `group.py`, `launch.py`: the ParallelContext a rank works with and the one rank start-up (torchrun, spawned local ranks);
- `ep/`: expert parallelism -- the exchange, plain EP, EPLB-style static placement and MoonEP balanced plans, attached to
  the model through its one seam (the MoE layer's ExpertBackend);
- `cp/`: context parallelism: a prompt's prefill split over ranks by position (`--cp`), and decode over the MLA pages sharded
  over them (`--dcp`);
- `serving/`: multi-rank engines -- rank 0 drives, the other ranks follow (the step channel, each rank's model, LocalEP for
  `LLM(ep=N)`, the torchrun entry of `openk3 serve --ep N`).

Engines and trainers need two calls: `init_from_env()` (under torchrun) for a ParallelContext, then
`attach_expert_parallel(model, ctx, method, replicated_tokens=...)`.
"""

from __future__ import annotations

import importlib
from typing import Any

# resolved lazily, so that openk3.parallel.config (the settings the CLI builds its flags from) imports without torch
_LAZY = {
    "EPMethod": "openk3.parallel.config",
    "ParallelConfig": "openk3.parallel.config",
    "ParallelContext": "openk3.parallel.group",
    "TokenSplit": "openk3.parallel.ep.backend",
    "attach_expert_parallel": "openk3.parallel.ep.backend",
    "build_backend": "openk3.parallel.ep.backend",
    "init_from_env": "openk3.parallel.launch",
    "run_ranks": "openk3.parallel.launch",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'openk3.parallel' has no attribute {name!r}")


__all__ = sorted(_LAZY)

"""Everything that runs on more than one rank, over torch.distributed (docs/ep.md):

- `group.py`, `launch.py`: the ParallelContext a rank works with and the one rank start-up (torchrun, spawned local ranks);
- `ep/`: expert parallelism -- the exchange, plain EP, EPLB-style static placement and MoonEP balanced plans, attached to
  the model through its one seam (the MoE layer's ExpertBackend);
- `serving/`: multi-rank engines -- rank 0 drives, the other ranks follow (the step channel, each rank's model, LocalEP for
  `LLM(ep=N)`, the torchrun entry of `openk3 serve --ep N`).

Engines and trainers need two calls: `init_from_env()` (under torchrun) for a ParallelContext, then
`attach_expert_parallel(model, ctx, method, replicated_tokens=...)`.
"""

from openk3.parallel.ep.backend import EPMethod, TokenSplit, attach_expert_parallel, build_backend
from openk3.parallel.group import ParallelContext
from openk3.parallel.launch import init_from_env, run_ranks

__all__ = ["EPMethod", "ParallelContext", "TokenSplit", "attach_expert_parallel", "build_backend", "init_from_env", "run_ranks"]

"""Expert parallelism over torch.distributed: plain EP, EPLB-style static placement and MoonEP balanced plans (docs/ep.md).

Engines and trainers need two calls: `init_from_env()` (under torchrun) for a ParallelContext, then
`attach_expert_parallel(model, ctx, method, replicated_tokens=...)`.
"""

from openk3.dist.backend import EPMethod, TokenSplit, attach_expert_parallel, build_backend
from openk3.dist.group import ParallelContext
from openk3.dist.launch import init_from_env, run_ranks

__all__ = ["EPMethod", "ParallelContext", "TokenSplit", "attach_expert_parallel", "build_backend", "init_from_env", "run_ranks"]

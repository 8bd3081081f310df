"""Entry point for `torchrun --nproc-per-node N -m tests.dist.torchrun_main`: the model cases through init_from_env, as JSON."""

from __future__ import annotations

import json

import torch.distributed as dist

from openk3.dist.launch import init_from_env
from tests.dist.ep_cases import model_cases

if __name__ == "__main__":
    ctx = init_from_env()
    print(json.dumps({"rank": ctx.rank, "world": ctx.world_size, "backend": ctx.backend_name, "errors": model_cases(ctx)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()

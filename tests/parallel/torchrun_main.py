"""Entry point for `torchrun --nproc-per-node N -m tests.parallel.torchrun_main`: the model cases through init_from_env, as JSON."""

from __future__ import annotations

import json
import os
import sys

import torch.distributed as dist

from openk3.parallel.launch import init_from_env
from tests.parallel.ep_cases import model_cases

if __name__ == "__main__":
    ctx = init_from_env()
    row = json.dumps({"rank": ctx.rank, "world": ctx.world_size, "backend": ctx.backend_name, "errors": model_cases(ctx)})
    # one write per line: print() writes the text and the newline separately, and two ranks share the same stdout
    os.write(sys.stdout.fileno(), (row + "\n").encode())
    dist.barrier()
    dist.destroy_process_group()
    # gloo's worker threads can abort the process in C++ static destruction at interpreter exit ("terminate called without an
    # active exception", seen about one run in three here); the row is already written, so leave without running destructors
    os._exit(0)

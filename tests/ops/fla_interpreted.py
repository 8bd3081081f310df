"""Run by tests/ops/test_kda_fla_interpreted.py in a subprocess, with fla on PYTHONPATH and TRITON_INTERPRET=1: fla's
real fused_recurrent_kda Triton kernel on CPU tensors, through openk3's seam (the "kda_prefill" entry "fla_recurrent")
and through the model's decode path. Prints one JSON object; the test judges it.

  python tests/ops/fla_interpreted.py ops     the entry against openk3's recurrence, case by case
  python tests/ops/fla_interpreted.py model   the debug model with kda="fla_recurrent" against its CPU ops
"""

from __future__ import annotations

import functools
import json
import sys
import warnings
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message="Triton is not supported")  # fla's note that it found no GPU

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "model")]

from openk3.ops.kda import fla_kernels  # noqa: E402
from openk3.ops.kda.naive import kda_recurrent  # noqa: E402
from openk3.ops.registry import OpTarget, registry  # noqa: E402

H, K, V = 2, 16, 32  # K != V: a state handed over in the wrong layout is a shape error, not a silent transpose


def ops() -> dict[str, Any]:
    """(B, T, cu_seqlens, initial state?) per case: fixed-length batches, packed sequences with an empty one, and a
    decode step of one-token sequences, which is what model/kda.py hands fla."""
    cases = {
        "2 sequences x 24 tokens, initial states": (2, 24, None, True),
        "1 sequence x 40 tokens, no initial state": (1, 40, None, False),
        "packed [5, 0, 24, 11], initial states": (1, 40, [0, 5, 5, 29, 40], True),
        "decode: 3 one-token sequences": (1, 3, [0, 1, 2, 3], True),
    }
    fn = registry().get("kda_prefill", "fla_recurrent", OpTarget(device="cuda"))
    g = torch.Generator().manual_seed(0)
    results = {}
    for name, (b, t, cu, with_state) in cases.items():
        r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
        q, k = F.normalize(r(b, t, H, K), dim=-1), F.normalize(r(b, t, H, K), dim=-1)
        v, log_decay, beta = r(b, t, H, V), F.logsigmoid(r(b, t, H, K)), torch.sigmoid(r(b, t, H))
        cu_seqlens = None if cu is None else torch.tensor(cu)
        s0 = r(b if cu is None else len(cu) - 1, H, K, V) if with_state else None
        o, s = fn(q, k, v, log_decay, beta, None, s0, cu_seqlens)
        o_ref, s_ref = kda_recurrent(q, k, v, log_decay, beta, None, s0, cu_seqlens)
        results[name] = {"output": float((o - o_ref).abs().max()), "state": float((s - s_ref).abs().max())}
    return results


def model() -> dict[str, Any]:
    """A packed prefill of three prompts on dirty slots, then two decode steps: logits of the model on fla's kernel, and
    of the model that prefills on its CPU ops and decodes on fla's kernel, against the same weights on openk3's CPU
    ops throughout; and which fla kernels ran with how many tokens per sequence."""
    from conftest import build

    from openk3.config import debug
    from openk3.model import CacheTensors, ForwardBatch, OpChoice

    calls: list[tuple[str, int, int]] = []
    fla = fla_kernels._fla_kda()

    def counted(kernel: str) -> Any:
        fn = getattr(fla, kernel)

        @functools.wraps(fn)  # the seam checks fla's signature through it
        def run(q: torch.Tensor, *args: Any, cu_seqlens: torch.Tensor | None = None, **kwargs: Any) -> Any:
            calls.append((kernel, q.shape[1], 1 if cu_seqlens is None else cu_seqlens.numel() - 1))
            return fn(q, *args, cu_seqlens=cu_seqlens, **kwargs)

        return run

    counting = SimpleNamespace(chunk_kda=counted("chunk_kda"), fused_recurrent_kda=counted("fused_recurrent_kda"))
    fla_kernels._fla_kda = lambda: counting  # type: ignore[assignment,return-value]
    prompts, slots = [[11, 3, 7, 9, 1], [200, 4, 5, 6, 7, 8, 9, 10, 12], [42]], [2, 0, 3]
    table = torch.arange(24).view(8, 3).t().contiguous().flip(1)  # scattered pages

    def logits(prefill_on_fla: bool, decode_on_fla: bool) -> list[torch.Tensor]:
        m = build(debug())
        cache = CacheTensors.allocate(m.config, num_slots=4, num_pages=24, page_size=4)
        for pool in cache.pools():  # dirty slots and pages: a fresh sequence must not read what an earlier one left
            pool.normal_(generator=torch.Generator().manual_seed(1))
        steps = [ForwardBatch.for_step(prompts, [0, 0, 0], slots, table)]
        steps += [ForwardBatch.for_step([[5 + i], [6 + i], [7 + i]], [len(p) + i for p in prompts], slots, table) for i in range(2)]
        out = []
        with torch.no_grad():
            for i, batch in enumerate(steps):
                if (prefill_on_fla if i == 0 else decode_on_fla) and m.ops.kda != "fla_recurrent":
                    m.select_ops(OpChoice(kda="fla_recurrent"), target=OpTarget(device="cuda"))  # CPU tensors: the interpreter runs fla
                out.append(m(batch, cache))
        return out

    reference = logits(prefill_on_fla=False, decode_on_fla=False)
    on_fla_throughout = logits(prefill_on_fla=True, decode_on_fla=True)
    resumed_on_fla = logits(prefill_on_fla=False, decode_on_fla=True)  # the CPU ops' states resume on fla (a prefix-cache hit)
    return {
        "max_abs_logit_diff": [float((a - b).abs().max()) for a, b in zip(reference, on_fla_throughout, strict=True)],
        "max_abs_logit_diff_resumed": [float((a - b).abs().max()) for a, b in zip(reference, resumed_on_fla, strict=True)],
        "logit_scale": float(max(x.abs().max() for x in reference)),
        "calls": [list(c) for c in calls],
        "kernels": dict(Counter(c[0] for c in calls)),
    }


if __name__ == "__main__":
    print(json.dumps({"ops": ops, "model": model}[sys.argv[1]]()))

"""No host sync on the decode forward's hot path: the tiny model's decode step, run by the engine (serve/runner.py ->
model forward), with every Python-level way of reading a tensor back to the host recorded by call site.

On CPU nothing actually waits, so the reads are caught where they are written: Tensor.item / tolist / cpu / numpy and
__bool__ / __int__ / __float__ / __index__ (an `if t:`, int(t) or range(t)), torch.equal (it answers a Python bool) and
.to() onto the CPU. The CUDA variant asks the driver instead (torch.cuda.set_sync_debug_mode), where CUDA exists.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import openk3
from openk3.config import debug
from openk3.llm import LLM
from openk3.model.model import K3ForCausalLM
from openk3.ops.registry import OpTarget
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

PACKAGE = Path(openk3.__file__).parent
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class Allowed(NamedTuple):
    per_step: int  # at most this many reads per decode step from the site (per batch, not per layer)
    why: str


# The host reads a decode forward is allowed, by the device its ops were chosen for, each with why it is the floor today.
ALLOWED: dict[str, dict[str, Allowed]] = {
    "cpu": {
        # the C kernel's slot-id range check before it writes through the ids: a read of CPU memory the kernel reads
        # anyway, not a device sync (the "c" backend exists only on CPU); two per KDA layer of the debug model
        "openk3/ops/kda/decode_fused.py:<genexpr>": Allowed(6, "C kernel range check on host memory"),
    },
    "cuda": {
        # the torch forms of the routed experts loop over experts in Python, so they need each expert's pair count (and
        # check the id range) on the host, per MoE layer. The no-sync form is moe_experts "triton" for packed MXFP4
        # experts (ops/triton/moe_mxfp4.py); a captured decode graph runs the fixed-shape form (moe_experts "static"),
        # which reads nothing back (tests/serve/test_decode_graphs.py).
        "openk3/ops/moe/single.py:moe_experts_single_token": Allowed(8, "per-expert loop (one token)"),
        "openk3/ops/moe/grouped.py:moe_experts_grouped": Allowed(4, "per-expert slice bounds"),
        "openk3/ops/moe/naive.py:check_moe_inputs": Allowed(8, "expert id range of the grouped form"),
    },
}


def call_site() -> str:
    """The innermost frame inside the package: 'openk3/<file>:<function>'."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = Path(frame.filename)
        if PACKAGE in path.parents:
            return f"{path.relative_to(PACKAGE.parent)}:{frame.name}"
    return "outside openk3"


@contextlib.contextmanager
def recording_host_reads(sites: Counter[str], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with monkeypatch.context() as m:
        for name in HOST_READS:
            real = getattr(torch.Tensor, name)
            m.setattr(torch.Tensor, name, _recorded(real, sites))
        m.setattr(torch, "equal", _recorded(torch.equal, sites))
        real_to = torch.Tensor.to

        def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = real_to(self, *args, **kwargs)
            if isinstance(out, torch.Tensor) and out.device.type == "cpu" and self.device.type != "cpu":
                sites[call_site()] += 1
            return out

        m.setattr(torch.Tensor, "to", to)
        yield


def _recorded(real: Callable[..., Any], sites: Counter[str]) -> Callable[..., Any]:
    def recorded(*args: Any, **kwargs: Any) -> Any:
        sites[call_site()] += 1
        return real(*args, **kwargs)

    return recorded


def decode_sites(monkeypatch: pytest.MonkeyPatch, batch_size: int, ops_for: str, device: str = "cpu") -> Counter[str]:
    """Host reads inside the model's forward over the engine's decode steps (prefill steps run unrecorded). `ops_for`: the
    device the ops are chosen for; "cuda" on CPU tensors runs the forms a CUDA target resolves to (the "any" backend)."""
    model = K3ForCausalLM(debug())
    model.init_weights(seed=3)
    llm = LLM(model.eval(), ByteTokenizer(256), num_pages=64, page_size=4, max_num_seqs=batch_size, max_model_len=64, device=device)
    model.select_ops(target=OpTarget(ops_for))
    runner = llm.engine.runner
    forward = runner.model
    sites: Counter[str] = Counter()
    decode_steps = 0

    def watched(batch: Any, cache: Any) -> torch.Tensor:
        nonlocal decode_steps
        if not batch.is_decode:
            return forward(batch, cache)
        decode_steps += 1
        with recording_host_reads(sites, monkeypatch):
            return forward(batch, cache)

    monkeypatch.setattr(runner, "model", watched)
    llm.generate([[1 + i, 2, 3, 4 + i] for i in range(batch_size)], SamplingParams(temperature=0, max_tokens=4))
    assert decode_steps >= 3
    return Counter({site: count // decode_steps for site, count in sites.items()})  # per step


@pytest.mark.parametrize("ops_for", ["cpu", "cuda"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_decode_forward_reads_nothing_back(monkeypatch: pytest.MonkeyPatch, batch_size: int, ops_for: str) -> None:
    sites = decode_sites(monkeypatch, batch_size, ops_for)
    allowed = ALLOWED[ops_for]
    unexpected = {site: n for site, n in sites.items() if site not in allowed or n > allowed[site].per_step}
    assert not unexpected, f"host reads per decode step, by call site: {dict(sorted(unexpected.items()))}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.set_sync_debug_mode)")
def test_decode_forward_has_no_cuda_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's own account: set_sync_debug_mode("warn") warns at every synchronising CUDA call, and the warning
    names the Python line that made it. The files of ALLOWED["cuda"] may sync (the MoE torch forms); nothing else may."""
    model = K3ForCausalLM(debug())
    model.init_weights(seed=3)
    llm = LLM(model.eval(), ByteTokenizer(256), num_pages=64, page_size=4, max_num_seqs=4, max_model_len=64, device="cuda")
    runner = llm.engine.runner
    forward = runner.model
    allowed_files = {site.split(":")[0] for site in ALLOWED["cuda"]}
    syncs: Counter[str] = Counter()

    def watched(batch: Any, cache: Any) -> torch.Tensor:
        if not batch.is_decode:
            return forward(batch, cache)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return forward(batch, cache)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                for w in caught:
                    path = Path(w.filename)
                    site = str(path.relative_to(PACKAGE.parent)) if PACKAGE in path.parents else str(path)
                    if "synchroniz" in str(w.message) and site not in allowed_files:
                        syncs[f"{site}:{w.lineno}"] += 1

    monkeypatch.setattr(runner, "model", watched)
    llm.generate([[1, 2, 3, 4], [5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    assert not syncs, f"CUDA syncs in the decode forward, by line: {dict(syncs)}"

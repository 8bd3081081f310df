"""`torchrun --nproc-per-node 2 -m openk3 serve --tp 2`: each rank reads its tensor-parallel blocks of the embedded tiny
checkpoint (MXFP4 experts split by width), rank 0 serves and drives; the completion equals a single process's and
SIGTERM to rank 0 stops both ranks cleanly."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import torch

from openk3.llm import LLM
from openk3.serve.sampling import SamplingParams
from tests.parallel.test_serve_ep import PROMPT, rank0_pid, stop, torchrun_server


@pytest.mark.slow
@pytest.mark.distributed
def test_serve_tp2_under_torchrun(tmp_path: Path) -> None:
    with torchrun_server(["--tp", "2"], tmp_path) as (proc, url, log):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)
        assert reply.status_code == 200, reply.text

        torch.set_num_threads(1)
        llm = LLM("tiny")
        want = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0]
        llm.close()
        assert reply.json()["choices"][0]["text"] == want.text

        stop(proc, rank0_pid(log))
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert re.search(r"rank 1: stopped after [1-9]\d* steps", text), text[-3000:]

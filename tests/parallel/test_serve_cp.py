"""`torchrun --nproc-per-node 2 -m openk3 serve --cp 2`: every rank holds the whole embedded tiny model, the prompt's
prefill chunks run split by position over both ranks (16-token chunks, split from 4 new tokens), decode whole on each;
the completion equals a single process's and SIGTERM to rank 0 stops both ranks cleanly."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import torch

from openk3.llm import LLM
from openk3.serve.sampling import SamplingParams
from tests.parallel.test_serve_ep import rank0_pid, stop, torchrun_server

PROMPT = "And God said, Let there be light: and there was light. And God saw the light, that it was good: and God divided the light from the darkness."


@pytest.mark.slow
@pytest.mark.distributed
def test_serve_cp2_under_torchrun(tmp_path: Path) -> None:
    flags = ["--cp", "2", "--cp-min-tokens", "4", "--max-num-batched-tokens", "16"]
    with torchrun_server(flags, tmp_path) as (proc, url, log):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["prompt_tokens"] > 16, "the prompt must take several chunks"

        torch.set_num_threads(1)
        llm = LLM("tiny", max_num_batched_tokens=16)
        want = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0]
        llm.close()
        assert reply.json()["choices"][0]["text"] == want.text

        stop(proc, rank0_pid(log))
    text = log.read_text()
    assert "cp=2: prefill steps of >= 4 new tokens split by position" in text, text[-3000:]
    assert proc.returncode == 0, text[-3000:]
    assert re.search(r"rank 1: stopped after [1-9]\d* steps", text), text[-3000:]

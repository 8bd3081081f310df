"""`torchrun --nproc-per-node 2 -m openk3 serve --cp 2 --enable-prefix-caching` (and `--nproc-per-node 4 ... --cp 2
--tp 2`): every rank holds the whole embedded tiny model (with --tp 2 its TP shard), the prompt's prefill chunks run split
by position over the CP ranks (32-token chunks, split from 4 new tokens), with the prefix cache's snapshots taken inside
the split chunks (8-token match unit: cuts inside CP rank 0's shard, on the shard boundary and inside CP rank 1's),
decode whole on each; a second prompt sharing the first's start hits a snapshot CP rank 1 took; both completions equal a
single process's without caching, and SIGTERM to rank 0 stops every rank cleanly."""

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
@pytest.mark.parametrize(("tp", "ep", "dcp"), [(1, 1, False), (2, 1, False), (1, 2, False), (1, 1, True)])
def test_serve_cp2_with_prefix_caching_under_torchrun(tmp_path: Path, tp: int, ep: int, dcp: bool) -> None:
    """tp = 2: `--cp 2 --tp 2`, four ranks (two TP groups of two, the CP groups across them); ep = 2: `--cp 2 --ep 2`,
    the experts spread over both ranks (MoonEP); dcp: `--cp 2 --dcp`, each rank holding half of every MLA page
    (parallel/cp/sharded_mla.py), the hit's pages and the tail page's copy each rank's share."""
    torch.set_num_threads(1)
    llm = LLM("tiny", max_num_batched_tokens=32)
    ids = llm.tokenizer.encode(PROMPT + " " + PROMPT)
    assert len(ids) > 64, "three chunks, the second with cuts at 40, 48 and 56"
    prompts = [ids, ids[:60] + ids[:20]]  # the second hits the snapshot at 56, inside rank 1's shard of [32, 64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].text for o in llm.generate(prompts, params)]
    llm.close()

    flags = ["--cp", "2", "--tp", str(tp), "--ep", str(ep), "--cp-min-tokens", "4", "--max-num-batched-tokens", "32"]
    flags += ["--enable-prefix-caching", "--prefix-match-unit", "8"] + (["--dcp"] if dcp else [])
    with torchrun_server(flags, tmp_path, nproc=2 * tp) as (proc, url, log):
        for prompt, text in zip(prompts, want, strict=True):
            body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
            reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == text
        hits = re.search(r"^\S*prefix_cache_hits_total\S* (\S+)$", httpx.get(f"{url}/metrics", timeout=10.0).text, re.MULTILINE)
        assert hits and float(hits.group(1)) == 56, "the second prompt starts from the snapshot at 56"
        stop(proc, rank0_pid(log))
    text = log.read_text()
    assert "cp=2: prefill steps of >= 4 new tokens split by position" in text, text[-3000:]
    assert ("decode CP: each rank holds 1/2 of every MLA page" in text) == dcp, text[-3000:]
    assert proc.returncode == 0, text[-3000:]
    for rank in range(1, 2 * tp):
        assert re.search(rf"rank {rank}: stopped after [1-9]\d* steps", text), text[-3000:]

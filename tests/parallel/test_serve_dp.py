"""`torchrun --nproc-per-node 2 -m openk3 serve --dp 2 --ep 2`: every rank runs an engine of its own behind rank 0's HTTP
server, the MoE layers span both. The texts equal a single process's, the two prompts of one request land on the two
ranks, repeats of the long one follow it to rank 1 and hit that rank's prefix cache, /metrics sums both ranks and
carries the EP stats of every rank's tokens, and SIGTERM to rank 0 stops both cleanly."""

from __future__ import annotations

import re

import httpx
import pytest
import torch

from openk3.config import preset
from openk3.llm import LLM
from openk3.serve.sampling import SamplingParams
from tests.parallel.test_serve_ep import rank0_pid, stop, torchrun_server

LONG = "And the earth was without form, and void; and darkness was upon the face of the deep. " * 3  # 67 tokens
# the two prompts of one request are placed together, before any step: the least-loaded rule puts the first on rank 0
# and LONG on rank 1, which becomes the home of LONG's first 64-token match unit (repeats of LONG follow it there)
PROMPTS = ["And God said", LONG]


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


def samples(text: str, name: str, label: str) -> dict[str, float]:
    """Every sample of a family by the value of one of its labels."""
    found = re.findall(rf'^{re.escape(name)}\{{[^}}]*{label}="([^"]*)"[^}}]*\}} (\S+)$', text, re.MULTILINE)
    return {key: float(value) for key, value in found}


def forwarded_tokens(usage: dict, num_samples: int) -> int:
    """Tokens a request ran through the model: its prompt but the cached part, and every sampled token but the last."""
    return usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] + usage["completion_tokens"] - num_samples


@pytest.mark.slow
@pytest.mark.distributed
def test_serve_dp2_ep2_under_torchrun(tmp_path) -> None:
    with torchrun_server(["--dp", "2", "--ep", "2", "--enable-prefix-caching"], tmp_path) as (proc, url, log):
        body = {"model": "tiny", "prompt": PROMPTS, "max_tokens": 10, "temperature": 0.0, "ignore_eos": True}
        batch = httpx.post(f"{url}/v1/completions", json=body, timeout=120.0)
        assert batch.status_code == 200, batch.text
        # an exact repeat misses (it cuts its prefill one token before the end, where the next repeat then hits)
        long_body = {**body, "prompt": LONG}
        repeats = [httpx.post(f"{url}/v1/completions", json=long_body, timeout=120.0) for _ in range(2)]
        assert all(r.status_code == 200 for r in repeats), [r.text for r in repeats]
        metrics = httpx.get(f"{url}/metrics", timeout=10.0).text
        info = httpx.get(f"{url}/server_info", timeout=10.0).json()
        assert info["max_running_requests"] == 2 * 4  # both ranks' engines, --max-num-seqs 4 each

        torch.set_num_threads(1)
        with LLM("tiny") as llm:
            want = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))]
        # read after the single process's run: the engine loop publishes a step's stats just after handing out its outputs
        ep_text = httpx.get(f"{url}/metrics", timeout=10.0).text
        got = sorted(batch.json()["choices"], key=lambda c: c["index"])
        assert [c["text"] for c in got] == want
        assert [r.json()["choices"][0]["text"] for r in repeats] == [want[1]] * 2
        last = repeats[1].json()["usage"]
        assert last["prompt_tokens_details"]["cached_tokens"] == last["prompt_tokens"] - 1  # rank 1's prefix cache

        # EP stats: every rank's routed entries, for the tokens both engines ran and for rank 0's dummy forwards while
        # rank 1 ran the repeats alone (at least one per sampled token); the last step: one token on each rank
        config = preset("tiny")
        top_k, moe_layers = config.moe.num_experts_per_token, [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
        tokens = forwarded_tokens(batch.json()["usage"], len(PROMPTS)) + sum(forwarded_tokens(r.json()["usage"], 1) for r in repeats)
        dummies = metric(ep_text, "openk3:ep_dummy_forwards_total")
        assert dummies >= 2 * 10
        recv = samples(ep_text, "openk3:ep_recv_tokens_total", "rank")
        assert set(recv) == {"0", "1"} and all(v > 0 for v in recv.values()), recv
        assert sum(recv.values()) == (tokens + dummies) * top_k * len(moe_layers), (recv, tokens, dummies)
        mean = samples(ep_text, "openk3:ep_recv_tokens_mean", "layer")
        assert mean == {str(i): float(top_k) for i in moe_layers}, mean
        assert set(samples(ep_text, "openk3:ep_maxvio", "layer")) == set(mean)
        assert metric(ep_text, "openk3:ep_bytes_sent_total") > 0

        # /metrics reads both ranks' engines: every prompt token of the three requests, wherever it ran
        prompt_tokens = batch.json()["usage"]["prompt_tokens"] + sum(r.json()["usage"]["prompt_tokens"] for r in repeats)
        assert metric(metrics, "openk3:prompt_tokens_total") == prompt_tokens
        assert metric(metrics, "openk3:num_requests_running") == 0
        assert metric(metrics, "openk3:state_free_slots") == 2 * 4  # both ranks' pools (--max-num-seqs 4 each), idle

        stop(proc, rank0_pid(log))
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert re.search(r"DP rank 1: 3 requests served in [1-9]\d* steps", text), text[-3000:]  # LONG, three times
    assert re.search(r"rank 1: stopped after [1-9]\d* steps", text), text[-3000:]

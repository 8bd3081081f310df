"""Prefill/decode disaggregation on a local Ray cluster: one prefill and one decode replica of the debug model behind the
front end. The decode replica serves each prompt from the prefill replica's record (its KDA state and MLA latents at
len(P) - 1: cached = prompt - 1) and its greedy text equals one aggregated engine's. Bounded as test_ray_replicas.py."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator

import httpx
import pytest
import torch

from tests.scale.test_ray_replicas import ARGV, local_deployment, wait_healthy

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (the `ray` extra)")

from openk3.llm import LLM  # noqa: E402
from openk3.scale.deploy import PREFILL_DEPLOYMENT, REPLICA_DEPLOYMENT, ScaleConfig  # noqa: E402
from openk3.scale.frontend import replica_ids  # noqa: E402
from openk3.serve.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.ray

PROMPT = "In the beginning God created the heaven and the earth. And the earth was without form, and void. " * 2


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    yield from local_deployment(ARGV, ScaleConfig(replicas=1, prefill_replicas=1, replica_cpus=1))


def test_decode_replica_serves_the_prefill_replicas_record(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=120) as client:
        wait_healthy(client, 2, 120)  # both pools report
        body = {"model": "debug", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1  # the record, not a recompute
        assert [r.headers["x-openk3-replica"]] == replica_ids("openk3", REPLICA_DEPLOYMENT)  # answered by the decode pool
        assert len(replica_ids("openk3", PREFILL_DEPLOYMENT)) == 1

        chat = {"model": "debug", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4, "temperature": 0}
        c = client.post("/v1/chat/completions", json=chat)
        assert c.status_code == 200, c.text
        assert c.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == c.json()["usage"]["prompt_tokens"] - 1

        metrics = client.get("/metrics").text
        assert re.search(r"^openk3:scale_handoffs_total 2\.0$", metrics, re.MULTILINE), metrics[-2000:]
        assert re.search(r"^openk3:scale_prefill_failures_total 0\.0$", metrics, re.MULTILINE)
        assert re.search(r'^openk3:cache_tier_hits_total\{[^}]*tier="inbox"[^}]*\} 2\.0$', metrics, re.MULTILINE), metrics[-3000:]

    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the preset's "random weights" warning
        with LLM("debug", max_model_len=1024) as llm:
            want = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].outputs[0].text
    assert r.json()["choices"][0]["text"] == want  # disaggregated greedy text = one aggregated engine's

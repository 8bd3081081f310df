"""A replica of two expert-parallel ranks (`--ep 2` with `--replicas 1`) on a local Ray cluster: the replica spawns its
second rank on its node, Ray reserves both ranks' CPUs for the replica's actor, and the completion equals one process's. Bounded as
test_ray_replicas.py."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import httpx
import pytest
import torch

from tests.scale.test_ray_replicas import ARGV, local_deployment, wait_healthy

pytest.importorskip("ray.serve", reason="ray[serve] is not installed (the `ray` extra)")

from openk3.launch.replicas import replica_application, replica_launch  # noqa: E402
from openk3.llm import LLM  # noqa: E402
from openk3.scale.deploy import ScaleConfig, replica_resources  # noqa: E402
from openk3.serve.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.ray

EP_ARGV = [*ARGV, "--ep", "2"]
PROMPT = "And God said, Let there be light: and there was light."


def test_a_replica_reserves_every_rank() -> None:
    assert replica_resources(replica_launch(EP_ARGV), ScaleConfig(replicas=1, replica_cpus=0.5)) == {"num_cpus": 1.0}
    assert replica_resources(replica_launch(ARGV), ScaleConfig(replicas=1)) == {"num_cpus": 1.0}
    with pytest.raises(ValueError, match="--prefill-replicas with multi-rank replicas"):
        replica_application(EP_ARGV, ScaleConfig(replicas=1, prefill_replicas=1))
    with pytest.raises(ValueError, match="kda='fla' cannot run on cpu"):  # --ops is checked before any replica loads weights
        replica_application([*ARGV, "--ops", "kda=fla"], ScaleConfig(replicas=1))


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    yield from local_deployment(EP_ARGV, ScaleConfig(replicas=1, replica_cpus=1))


def test_two_rank_replica_serves_one_process_tokens(base_url: str) -> None:
    with httpx.Client(base_url=base_url, timeout=120) as client:
        wait_healthy(client, 1, 120)
        body = {"model": "debug", "prompt": PROMPT, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the preset's "random weights" warning
        with LLM("debug", max_model_len=1024) as llm:
            want = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].outputs[0].text
    assert r.json()["choices"][0]["text"] == want

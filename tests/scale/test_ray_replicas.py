"""Two debug-model replicas on a local Ray cluster behind the front end, under each router (prefix-aware and Ray's power of
two): prefix-aware routing and a cross-replica prefix pull, the aggregated /health and /metrics (every replica's own report), a killed replica's request
served by the other, and its replacement back in service. Bounded: Ray must start within 90 s (probed in a child process
first) and the replicas report healthy within 120 s (a bound, not a race: the assertions wait for events, never for a time)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

ray = pytest.importorskip("ray", reason="ray[serve] is not installed (the `ray` extra)")
serve = pytest.importorskip("ray.serve")

from openk3.launch.replicas import replica_application  # noqa: E402
from openk3.scale.cluster import RayStartError, connect  # noqa: E402
from openk3.scale.deploy import ScaleConfig  # noqa: E402

pytestmark = pytest.mark.ray

ARGV = ["--model", "debug", "--enable-prefix-caching", "--torch-threads", "1", "--max-model-len", "1024"]
SYSTEM = "You are a careful assistant who answers in short sentences. " * 6  # about 360 byte tokens: several 64-token units


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PROBE = "import ray; ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False); ray.shutdown()"


def ray_can_start(bound_s: float) -> str | None:
    """Why a local Ray cluster cannot start here, or None. In a child process: where Ray's GCS cannot come up, Ray ends
    the whole process, which must not be the test run."""
    try:
        probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=bound_s)
    except subprocess.TimeoutExpired:
        return f"a local Ray cluster did not start within {bound_s:g} s"
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"a local Ray cluster cannot start (exit {probe.returncode}): {tail}"
    return None


def local_deployment(argv: list[str], config: ScaleConfig) -> Iterator[str]:
    """For a module fixture (`yield from`): the application on a local 2-CPU Ray cluster, its URL, then the cluster gone.
    Skips the module where Ray cannot start."""
    reason = ray_can_start(90)
    if reason is not None:
        pytest.skip(reason)
    try:
        connect(None, num_cpus=2)
    except RayStartError as e:
        pytest.skip(f"Ray cannot start here: {e}")
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(replica_application(argv, config), name="openk3", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module", params=["prefix", "pow2"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    for url in local_deployment(ARGV, ScaleConfig(replicas=2, replica_cpus=1, router=request.param)):
        yield url, request.param


def chat(client: httpx.Client, turns: list[str]) -> httpx.Response:
    messages = [{"role": "system", "content": SYSTEM}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    body = {"model": "debug", "messages": messages, "max_tokens": 4, "temperature": 0}
    return client.post("/v1/chat/completions", json=body)


def wait_healthy(client: httpx.Client, replicas: int, bound_s: float, gone: str | None = None) -> dict:
    """The front end's /health once it reports `replicas` healthy (and `gone` no longer among them): its board is the
    last background probe's, so a replica killed a moment ago may still show until the next probe (health_board.py)."""
    deadline = time.monotonic() + bound_s
    while True:
        r = client.get("/health")
        report = r.json()
        if report["healthy"] == replicas and len(report["replicas"]) == replicas and gone not in report["replicas"]:
            return report
        assert time.monotonic() < deadline, f"replicas did not come back within {bound_s} s: {report}"
        time.sleep(0.5)


def test_replicas_route_aggregate_and_survive_a_kill(served: tuple[str, str]) -> None:
    base_url, router = served
    with httpx.Client(base_url=base_url, timeout=120) as client:
        wait_healthy(client, 2, 120)
        for _ in range(3):  # every report reaches the replica it is meant for, under either router
            assert client.get("/health").json()["healthy"] == 2
        r1 = chat(client, ["What is the capital of France? Answer in one word please."])
        assert r1.status_code == 200, r1.text
        home = r1.headers["x-openk3-replica"]
        reply = r1.json()["choices"][0]["message"]["content"]
        r2 = chat(client, ["What is the capital of France? Answer in one word please.", reply, "And of Italy?"])
        assert r2.status_code == 200, r2.text
        if router == "prefix":
            assert r2.headers["x-openk3-replica"] == home  # the conversation follows its cache
            assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
            # a new conversation goes to the other replica (sent fewer requests), which pulls the system prompt from home
            fresh = chat(client, ["Which river runs through Paris? One word."])
            assert fresh.status_code == 200, fresh.text
            assert fresh.headers["x-openk3-replica"] != home
            assert fresh.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 320
            pulled = [line for line in client.get("/metrics").text.splitlines() if line.startswith("openk3:prefix_cache_remote_pulls_total")]
            assert any(f'replica="{fresh.headers["x-openk3-replica"]}"' in line and line.endswith(" 1.0") for line in pulled), pulled

        metrics = client.get("/metrics").text
        assert f'replica="{home}"' in metrics and "openk3:scale_replicas" in metrics

        ray.kill(ray.get_actor(f"SERVE_REPLICA::openk3#EngineReplica#{home}", namespace="serve"), no_restart=True)
        r3 = chat(client, ["What is the capital of France? Answer in one word please.", reply, "And of Spain?"])
        assert r3.status_code == 200, r3.text  # retried or routed elsewhere: never an error for a request nobody answered
        assert r3.headers["x-openk3-replica"] != home

        # Ray replaces the killed replica; the front end routes to it and reports it
        back = wait_healthy(client, 2, 120, gone=home)
        assert back["status"] == "ok" and back["unhealthy"] == 0
        r4 = chat(client, ["Name a colour."])
        assert r4.status_code == 200, r4.text

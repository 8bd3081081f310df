"""`torchrun --nproc-per-node 2 -m openk3 serve --ep 2`: rank 0 serves HTTP and drives, rank 1 follows; the completion equals
a single process's, the EP stats reach /metrics, and SIGTERM stops both ranks cleanly: sent to rank 0 (torchrun then exits 0),
or to torchrun, which forwards it to every rank (the worker waits for rank 0's STOP)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from openk3.llm import LLM
from openk3.parallel.launch import free_port
from openk3.serve.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "And God said"
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0


def wait_until_up(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"torchrun exited with {proc.returncode} before serving:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    pytest.fail(f"server not up after {START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def start_torchrun(parallel_flags: list[str], tmp_path: Path, nproc: int = 2) -> tuple[subprocess.Popen, str, Path]:
    """`torchrun --nproc-per-node <nproc> -m openk3 serve --model tiny <flags>` in a session of its own (so a failing test
    can kill torchrun and every rank at once): the process, its URL and its log file."""
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this Python")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [torchrun, "--standalone", "--nproc-per-node", str(nproc), "-m", "openk3", "serve", "--model", "tiny", *parallel_flags]
    cmd += ["--port", str(port), "--torch-threads", "1", "--max-num-seqs", "4", "--log-level", "info"]
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log


@contextlib.contextmanager
def torchrun_server(parallel_flags: list[str], tmp_path: Path, nproc: int = 2) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """start_torchrun, up and serving; whatever the test does, torchrun and its ranks are gone afterwards (killed if the
    test did not stop them)."""
    proc, url, log = start_torchrun(parallel_flags, tmp_path, nproc)
    try:
        wait_until_up(url, proc, log)
        yield proc, url, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def rank0_pid(log: Path) -> int:
    """Rank 0's process, as uvicorn logs it when it starts serving."""
    started = re.search(r"Started server process \[(\d+)\]", log.read_text())
    assert started, log.read_text()[-3000:]
    return int(started.group(1))


def stop(proc: subprocess.Popen, pid: int) -> None:
    """SIGTERM to `pid` (rank 0, or torchrun itself), then torchrun's exit."""
    os.kill(pid, signal.SIGTERM)
    proc.wait(timeout=STOP_TIMEOUT_S)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("sent_to", ["rank0", "torchrun"])
def test_serve_ep2_under_torchrun(sent_to: str, tmp_path: Path) -> None:
    with torchrun_server(["--ep", "2"], tmp_path) as (proc, url, log):
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)
        assert reply.status_code == 200, reply.text
        metrics = httpx.get(f"{url}/metrics", timeout=10.0).text

        torch.set_num_threads(1)
        llm = LLM("tiny")
        want = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0]
        llm.close()
        choice = reply.json()["choices"][0]
        assert choice["text"] == want.text and reply.json()["usage"]["completion_tokens"] == len(want.token_ids) == 12
        assert re.search(r'openk3:ep_recv_tokens_max\{layer="\d+",model_name="tiny"\} [1-9]', metrics), metrics[-2000:]
        assert re.search(r'openk3:ep_bytes_sent_total\{model_name="tiny"\} [1-9]', metrics)

        stop(proc, rank0_pid(log) if sent_to == "rank0" else proc.pid)
    text = log.read_text()
    if sent_to == "rank0":
        assert proc.returncode == 0, text[-3000:]  # torchrun saw both ranks exit 0
    assert "rank 0: signal 15, stopping the workers" in text and re.search(r"rank 1: stopped after [1-9]\d* steps", text), text[-3000:]

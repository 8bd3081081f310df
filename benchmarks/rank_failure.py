"""Rank failures as an operator meets them (issue 36): how long until the fault is found, a client is answered, the group exits.

Three faults, each on real processes, against the openk3 in `--code` (default: this checkout; give an older checkout for a
before/after table):

- `llm-stop`: `LLM("debug", ep=2)`, SIGSTOP of the worker while a generate runs; time until generate raises, and close().
- `serve-stop` / `serve-kill`: `torchrun --nproc-per-node 2 -m openk3 serve --model debug --ep 2`, SIGSTOP (SIGKILL) of rank
  1 while idle, a completion 0.5 s later: its answer (seconds, status, Retry-After, error code), then /health, then the
  seconds until torchrun exits (torchrun itself waits 30 s before it SIGKILLs a stopped rank that ignores its SIGTERM).
- `no-main-guard`: a script that calls `LLM("debug", tp=2)` without an `if __name__ == "__main__":` guard; time until it
  ends, and its last line.

Every wait is bounded by `--bound-s`; "none within N s" is the answer when it runs out.

  .venv/bin/python benchmarks/rank_failure.py
  .venv/bin/python benchmarks/rank_failure.py --code /path/to/old/checkout --ep-timeout-s 60
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

LLM_STOP = """
import os, signal, sys, threading, time, warnings
warnings.simplefilter("ignore")
import torch
from openk3.llm import LLM
from openk3.serve.sampling import SamplingParams
if __name__ == "__main__":
    torch.set_num_threads(1)
    llm = LLM("debug", ep=2, ep_method="ep", ep_timeout_s={ep_timeout_s})
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0.0))
    pid = llm._ep.workers[0].pid
    stopped = []
    threading.Timer(1.0, lambda: (os.kill(pid, signal.SIGSTOP), stopped.append(time.monotonic()))).start()
    try:
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=100000, ignore_eos=True, temperature=0.0))
        print("RESULT generate finished without an error")
    except Exception as e:
        print(f"RESULT generate raised {{time.monotonic() - stopped[0]:.1f}} s after SIGSTOP: {{type(e).__name__}}")
    t = time.monotonic()
    os.kill(pid, signal.SIGCONT)
    llm.close()
    print(f"RESULT close() took {{time.monotonic() - t:.1f}} s")
"""

NO_MAIN_GUARD = """
from openk3.llm import LLM
LLM("debug", tp=2)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_script(code: Path, source: str, bound_s: float) -> tuple[float, str, str]:
    """(seconds, exit, the RESULT lines or the last stderr line) of a script run against `code`."""
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS="1")
    t = time.monotonic()
    try:
        done = subprocess.run([sys.executable, f.name], env=env, cwd=code, capture_output=True, text=True, timeout=bound_s)
    except subprocess.TimeoutExpired:
        return bound_s, "none", f"still running after {bound_s:g} s (killed)"
    finally:
        os.unlink(f.name)
    results = [line[len("RESULT ") :] for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    errors = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith(" ")]
    return time.monotonic() - t, str(done.returncode), "; ".join(results) or (errors[-1][:300] if errors else "")


def serve_fault(code: Path, fault: str, bound_s: float, extra: list[str]) -> list[str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "openk3", "serve", "--model", "debug", "--ep", "2"]
    cmd += ["--port", str(port), "--torch-threads", "1", *extra]
    proc = subprocess.Popen(cmd, env=env, cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    base, lines, rank1 = f"http://127.0.0.1:{port}", [], None
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                return ["the server did not start"]
            time.sleep(0.5)
        body = {"model": "debug", "prompt": "Once upon", "max_tokens": 4}
        httpx.post(base + "/v1/completions", json=body, timeout=60)
        ranks = sorted(int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split())
        rank1 = ranks[1]
        t0 = time.monotonic()
        os.kill(rank1, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
        time.sleep(0.5)
        t = time.monotonic()
        try:
            r = httpx.post(base + "/v1/completions", json=body, timeout=bound_s)
            code_ = r.json().get("error", {}).get("code") if r.headers.get("content-type", "").startswith("application/json") else r.text[:40]
            lines.append(f"request 0.5 s later: {r.status_code} after {time.monotonic() - t:.1f} s, Retry-After {r.headers.get('retry-after')}, {code_}")
        except httpx.HTTPError as e:
            lines.append(f"request 0.5 s later: {type(e).__name__} after {time.monotonic() - t:.1f} s")
        try:
            h = httpx.get(base + "/health", timeout=10)
            lines.append(f"/health then: {h.status_code}")
        except httpx.HTTPError as e:
            lines.append(f"/health then: {type(e).__name__}")
        try:
            rc = proc.wait(timeout=bound_s)
            lines.append(f"torchrun exited {time.monotonic() - t0:.1f} s after the signal, rc {rc}")
        except subprocess.TimeoutExpired:
            lines.append(f"torchrun still running {time.monotonic() - t0:.1f} s after the signal")
        return lines
    finally:
        if rank1 is not None:
            try:
                os.kill(rank1, signal.SIGCONT)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--code", type=Path, default=ROOT, help="the openk3 checkout to run (PYTHONPATH)")
    p.add_argument("--bound-s", type=float, default=120.0, help="the longest any one wait may take")
    p.add_argument("--ep-timeout-s", type=float, default=60.0, help="ep_timeout_s of every run (the group's collective timeout)")
    p.add_argument("--only", choices=("llm-stop", "serve-stop", "serve-kill", "no-main-guard"), action="append")
    args = p.parse_args()
    git = subprocess.run(["git", "-C", str(args.code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    commit = git.stdout.strip() or "not a git checkout"
    print(f"command: `{' '.join([Path(sys.executable).name, *sys.argv])}`")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; code {args.code} (commit {commit})\n")
    print("| fault | what happened |\n|---|---|")
    chosen = args.only or ["llm-stop", "serve-stop", "serve-kill", "no-main-guard"]
    if "llm-stop" in chosen:
        secs, rc, said = run_script(args.code, LLM_STOP.format(ep_timeout_s=args.ep_timeout_s), args.bound_s)
        print(f"| LLM(ep=2), SIGSTOP of rank 1 mid-generate | {said} (script: {secs:.1f} s, exit {rc}) |")
    for fault in ("stop", "kill"):
        if f"serve-{fault}" in chosen:
            lines = serve_fault(args.code, fault, args.bound_s, ["--ep-timeout-s", str(args.ep_timeout_s)])
            print(f"| serve --ep 2 under torchrun, SIG{fault.upper()} of rank 1 while idle | {'; '.join(lines)} |")
    if "no-main-guard" in chosen:
        secs, rc, said = run_script(args.code, NO_MAIN_GUARD, args.bound_s)
        print(f"| LLM(tp=2) in a script without a __main__ guard | ended after {secs:.1f} s, exit {rc}: {said} |")


if __name__ == "__main__":
    main()

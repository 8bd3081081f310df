"""Replica failures on Ray as an operator meets them (issue 36 item 4): the prefill replica lost, and SIGTERM to the group.

`openk3 serve --model debug --replicas 1 --prefill-replicas 1` (the openk3 in `--code`, default this checkout) in a process
group of its own; once both replicas report healthy and one completion has been served:

- `prefill-kill`: SIGKILL of the prefill replica's process (found among the server's descendants by its Ray process title),
  a completion 0.5 s later (its seconds and status), /health polled every 0.25 s from the kill (how long until it stops
  saying "2 healthy", the slowest /health answer), the seconds until it reports 2 healthy replicas again with a new prefill
  replica, and `openk3:scale_prefill_failures_total` at the end;
- `group-term`: SIGTERM to the server's whole process group: the seconds until the server exits, its exit code, and
  the server's descendants still alive 5 s after it exited.

Every wait is bounded by `--bound-s`.

  .venv/bin/python benchmarks/ray_failure.py
  .venv/bin/python benchmarks/ray_failure.py --code /path/to/old/checkout
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "In the beginning God created the heaven and the earth. And the earth was without form, and void. " * 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def descendants(root: int) -> dict[int, str]:
    """pid -> command line of every live descendant of `root` (from /proc)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, todo = {}, [root]
    while todo:
        p = todo.pop()
        for child, ppid in parent.items():
            if ppid == p and child not in found:
                try:
                    found[child] = (Path("/proc") / str(child) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                except OSError:
                    continue
                todo.append(child)
    return found


def health(client: httpx.Client) -> tuple[float, int, dict]:
    t = time.monotonic()
    try:
        r = client.get("/health", timeout=30)
        return time.monotonic() - t, r.status_code, r.json()
    except (httpx.HTTPError, ValueError) as e:
        return time.monotonic() - t, 0, {"error": type(e).__name__}


def completion(client: httpx.Client) -> tuple[float, str]:
    t = time.monotonic()
    body = {"model": "debug", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    try:
        r = client.post("/v1/completions", json=body, timeout=120)
        return time.monotonic() - t, str(r.status_code)
    except httpx.HTTPError as e:
        return time.monotonic() - t, type(e).__name__


def wait_two_healthy(client: httpx.Client, bound_s: float, t0: float) -> dict | None:
    while time.monotonic() - t0 < bound_s:
        _, status, body = health(client)
        if status == 200 and body.get("healthy") == 2 and len(body.get("replicas", {})) == 2:
            return body
        time.sleep(0.25)
    return None


def prefill_kill(server: subprocess.Popen[bytes], client: httpx.Client, bound_s: float) -> list[str]:
    before = wait_two_healthy(client, bound_s, time.monotonic())
    if before is None:
        return [f"the replicas did not report healthy within {bound_s:g} s"]
    seconds, status = completion(client)
    rows = [f"warm-up completion: {status} in {seconds:.1f} s"]
    victims = [p for p, cmd in descendants(server.pid).items() if "PrefillReplica" in cmd]
    if len(victims) != 1:
        return rows + [f"found {len(victims)} prefill replica processes, expected 1"]
    os.kill(victims[0], signal.SIGKILL)
    t0 = time.monotonic()
    answer: list[tuple[float, str]] = []

    def late_request() -> None:
        time.sleep(0.5)
        answer.append(completion(client))

    request = threading.Thread(target=late_request)
    request.start()
    detected: tuple[float, int, object, object] | None = None
    slowest, recovered = 0.0, None
    while time.monotonic() - t0 < bound_s:
        latency, code, body = health(client)
        slowest = max(slowest, latency)
        now = time.monotonic() - t0
        if detected is None and body.get("healthy") != 2:
            detected = (now, code, body.get("healthy"), body.get("status"))
        if now > 1.0 and code == 200 and body.get("healthy") == 2 and set(body.get("replicas", {})) != set(before["replicas"]):
            recovered = now
            break
        time.sleep(0.25)
    request.join(bound_s)
    metrics = client.get("/metrics", timeout=30).text
    failures = re.search(r"^openk3:scale_prefill_failures_total (\S+)$", metrics, re.MULTILINE)
    rows.append("completion 0.5 s after the kill: " + (f"{answer[0][1]} after {answer[0][0]:.1f} s" if answer else f"none within {bound_s:g} s"))
    rows.append(
        "/health: "
        + (f"says {detected[2]} healthy ({detected[3]}, HTTP {detected[1]}) {detected[0]:.1f} s after the kill" if detected else "never left 2 healthy")
        + f"; slowest /health answer {slowest:.1f} s"
    )
    back = f"{recovered:.1f} s after the kill" if recovered is not None else f"not within {bound_s:g} s"
    rows.append(f"recovered (2 healthy, a new prefill replica): {back}")
    rows.append(f"scale_prefill_failures_total: {failures.group(1) if failures else 'absent'}")
    return rows


def group_term(server: subprocess.Popen[bytes], bound_s: float) -> list[str]:
    family = descendants(server.pid)
    t0 = time.monotonic()
    os.killpg(server.pid, signal.SIGTERM)
    try:
        rc: int | str = server.wait(bound_s)
    except subprocess.TimeoutExpired:
        rc = f"none within {bound_s:g} s"
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    took = time.monotonic() - t0
    time.sleep(5)
    alive = [pid for pid in family if Path(f"/proc/{pid}").exists() and "ray" in family[pid]]
    for pid in alive:  # leave nothing of this run behind
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return [f"SIGTERM to the group: server exited {took:.1f} s later, exit {rc}; {len(alive)} of its Ray processes still alive 5 s after"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code", type=Path, default=ROOT, help="the openk3 checkout to run (default: this one)")
    p.add_argument("--bound-s", type=float, default=180.0)
    args = p.parse_args()
    code = args.code.resolve()
    port = free_port()
    argv = [sys.executable, "-m", "openk3", "serve", "--model", "debug", "--enable-prefix-caching", "--torch-threads", "1", "--max-model-len", "1024"]
    argv += ["--replicas", "1", "--prefill-replicas", "1", "--host", "127.0.0.1", "--port", str(port)]
    env = dict(os.environ, PYTHONPATH=str(code), OMP_NUM_THREADS="1")
    log = open(os.devnull, "wb")  # noqa: SIM115
    server = subprocess.Popen(argv, cwd=code, env=env, stdout=log, stderr=log, start_new_session=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            t = time.monotonic()
            while time.monotonic() - t < args.bound_s:
                try:
                    client.get("/health", timeout=5)
                    break
                except httpx.HTTPError:
                    time.sleep(1)
            rows = prefill_kill(server, client, args.bound_s)
        rows += group_term(server, args.bound_s)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
    commit = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "not a git checkout"
    print(f"command: python benchmarks/ray_failure.py{' --code ' + str(args.code) if args.code != ROOT else ''} --bound-s {args.bound_s:g}")
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; code {code.name} ({commit})\n")
    print("| fault | what happened |\n|---|---|")
    print("| prefill replica SIGKILLed (1 prefill + 1 decode, debug model) | " + "; ".join(rows[:-1]) + " |")
    print("| SIGTERM to the server's process group | " + rows[-1] + " |")


if __name__ == "__main__":
    main()

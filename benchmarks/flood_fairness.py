"""A flood from one client and a small request from another: the probe's time to first token under fcfs, fair and priority.

One client (`"user": "flood"`) opens `--flood` streaming completions that each run to the end of the context (ignore_eos,
as many tokens as the context leaves), more than the server's `--max-num-seqs` slots; once every slot is busy, another
client (`"user": "probe"`) sends a short prompt for 2 tokens and the script times its first token. The same workload runs
against `openk3 serve --scheduling-policy fcfs`, `fair` and `priority` (the demo model; under `priority` the probe says
`"priority": -1`, the flood the default 0), alternating, `--rounds` times each, in one run. A probe that gets no token
within `--probe-timeout` seconds is reported as "> timeout" (the ratio is then a lower bound). Correctness first: the probe's
greedy text under each policy must equal its text on the idle server, or no ratio is reported.

    python benchmarks/flood_fairness.py [--flood 100] [--max-num-seqs 16] [--max-model-len 1024] [--rounds 2]
                                        [--probe-timeout 60] [--out benchmarks/results/flood_fairness.md]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
FLOOD_PROMPT = "Write the longest story you can about a lighthouse keeper and the sea. " * 4
PROBE_PROMPT = "Hello"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(args: argparse.Namespace, policy: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "openk3", "serve", "--model", args.model, "--port", str(port), "--scheduling-policy", policy]
    cmd += ["--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"openk3 serve exited with {proc.returncode}: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("openk3 serve did not become healthy in 300 s")


async def first_token(client: httpx.AsyncClient, body: dict, started: asyncio.Event | None = None) -> tuple[float, str]:
    """Seconds from sending to the first text, and the whole text (a stream read to its end)."""
    t0, ttft, text = time.perf_counter(), None, []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if ttft is None:
                ttft = time.perf_counter() - t0
                if started is not None:
                    started.set()
            text.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["text"])
    return (ttft if ttft is not None else float("nan")), "".join(text)


async def one_round(args: argparse.Namespace, base: str, priority: int) -> tuple[float | None, str, str]:
    """(probe TTFT in seconds or None after the timeout, its text under the flood, its text on the idle server)."""
    limits = httpx.Limits(max_connections=args.flood + 8)
    async with httpx.AsyncClient(base_url=base, timeout=None, limits=limits) as client:
        probe = {"model": args.model, "prompt": PROBE_PROMPT, "max_tokens": 2, "temperature": 0, "user": "probe", "priority": priority}
        _, idle_text = await first_token(client, probe)
        flood = {"model": args.model, "prompt": FLOOD_PROMPT, "max_tokens": None, "ignore_eos": True, "temperature": 0, "user": "flood"}
        events = [asyncio.Event() for _ in range(args.flood)]
        tasks = [asyncio.create_task(first_token(client, flood, e)) for e in events]
        while sum(e.is_set() for e in events) < min(args.flood, args.max_num_seqs):  # every slot busy with the flood
            await asyncio.sleep(0.05)
        try:
            ttft, text = await asyncio.wait_for(first_token(client, probe), args.probe_timeout)
            got: float | None = ttft
        except asyncio.TimeoutError:
            got, text = None, ""
        for t in tasks:
            t.cancel()  # the streams close: the server aborts the flood
        await asyncio.gather(*tasks, return_exceptions=True)
    return got, text, idle_text


def run_policy(args: argparse.Namespace, policy: str) -> tuple[float | None, bool]:
    port = free_port()
    server = start_server(args, policy, port)
    try:
        ttft, text, idle = asyncio.run(one_round(args, f"http://127.0.0.1:{port}", -1 if policy == "priority" else 0))
    finally:
        server.terminate()
        server.wait(timeout=60)
    return ttft, ttft is None or text == idle


def fmt(values: list[float | None], timeout: float) -> str:
    if any(v is None for v in values):
        return f"> {timeout:g} s ({sum(v is None for v in values)} of {len(values)} got no token)"
    done = [v for v in values if v is not None]
    return f"{statistics.median(done):.2f} s (max {max(done):.2f})"


def ratio(base: list[float | None], values: list[float | None], timeout: float, correct: bool) -> str:
    """How many times sooner than fcfs (medians; a timed-out fcfs probe counts as the timeout, making the ratio a bound)."""
    if values is base:
        return "baseline"
    if not correct or any(v is None for v in values):
        return "n/a"
    done = [v for v in values if v is not None]
    bound = ">= " if any(v is None for v in base) else ""
    return f"{bound}{statistics.median([timeout if v is None else v for v in base]) / statistics.median(done):.0f}x"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--flood", type=int, default=100, help="streams from the flooding client")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024, help="each flood stream runs to this length")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--probe-timeout", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = p.parse_args()

    results: dict[str, list[float | None]] = {"fcfs": [], "fair": [], "priority": []}
    correct = True
    for _ in range(args.rounds):
        for policy in results:  # alternating: drift in the machine's load hits both alike
            ttft, ok = run_policy(args, policy)
            results[policy].append(ttft)
            correct &= ok

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lines = [
        f"# Flood fairness: a 2-token probe's TTFT while one client floods `{args.model}`",
        "",
        f"command: `python benchmarks/flood_fairness.py {' '.join(sys.argv[1:])}`",
        f"{platform.machine()} CPU ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end), commit {commit}",
        f"workload: {args.flood} streams from user 'flood' (ignore_eos, to {args.max_model_len} tokens) over {args.max_num_seqs} slots, "
        f"then one 2-token greedy request from user 'probe' (priority -1 under the priority policy); {args.rounds} rounds per policy, alternating",
        f"correctness: the probe's greedy text under the flood == its text on the idle server: {'yes' if correct else 'NO'}",
        "",
        "| policy | probe TTFT median (max) | sooner than fcfs |",
        "|---|---:|---:|",
    ]
    lines += [
        f"| {policy} | {fmt(values, args.probe_timeout)} | {ratio(results['fcfs'], values, args.probe_timeout, correct)} |"
        for policy, values in results.items()
    ]
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out is not None:
        args.out.write_text(table)
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())

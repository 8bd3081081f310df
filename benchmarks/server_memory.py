"""RSS of a live `openk3 serve` over a run of large requests, with the C heap kept or the C library's defaults, and the idle
trim on or off (serve/heap_trim.py): the issue this answers is memory that never comes back after large requests.

Each configuration starts its own server (the tiny model), takes the RSS once it has served one small request, then sends
`--requests` requests alternating a ~3.5 MB /tokenize and a ~7.5 KB /v1/completions (8 tokens), and reads the RSS after each
pair and once more after the last (the idle trim runs as the last request ends). Reported: the RSS at the start, the peak,
the RSS at the end and its growth over the start; and the mean latency of the completions, the cost of trimming when a
server keeps going idle between requests. Same run, same machine, one configuration after another.

    python benchmarks/server_memory.py [--requests 100]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

CONFIGS = [("keep", -1.0), ("keep", 256.0), ("system", -1.0), ("system", 256.0)]  # (--cpu-heap, --heap-trim-slack-mb)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def _post(port: int, path: str, body: dict) -> int:
    data = json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def run(heap: str, slack_mb: float, requests: int) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "openk3", "serve", "--model", "tiny", "--port", str(port), "--cpu-heap", heap, "--heap-trim-slack-mb", str(slack_mb)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                break
            except OSError:
                time.sleep(0.2)
        _post(port, "/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 4})
        time.sleep(0.5)
        start = peak = _rss_mb(server.pid)
        big, mid, latencies, codes = "word " * 700_000, "word " * 1500, [], set()
        for _ in range(requests // 2):
            codes.add(_post(port, "/tokenize", {"model": "tiny", "prompt": big}))
            t0 = time.perf_counter()
            codes.add(_post(port, "/v1/completions", {"model": "tiny", "prompt": mid, "max_tokens": 8}))
            latencies.append(time.perf_counter() - t0)
            peak = max(peak, _rss_mb(server.pid))
        time.sleep(1.0)  # the idle trim runs on a worker thread once the last request has ended
        end = _rss_mb(server.pid)
        return {"start": start, "peak": max(peak, end), "end": end, "latency": sum(latencies) / len(latencies), "codes": sorted(codes)}
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=100)
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"command: python benchmarks/server_memory.py --requests {args.requests}; commit {commit}\n")
    print("| --cpu-heap | idle trim | RSS at start MB | peak MB | at end MB | growth MB | completion latency s | statuses |")
    print("|---|---|---|---|---|---|---|---|")
    for heap, slack in CONFIGS:
        r = run(heap, slack, args.requests)
        trim = "off" if slack < 0 else f"slack {slack:g} MiB"
        print(f"| {heap} | {trim} | {r['start']:.0f} | {r['peak']:.0f} | {r['end']:.0f} | {r['end'] - r['start']:+.0f} | {r['latency']:.3f} | {r['codes']} |")


if __name__ == "__main__":
    main()

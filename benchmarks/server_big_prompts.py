"""Other streams' inter-token latency while large prompts arrive at a live `openk3 serve` (the tiny model).

Tokenising a multi-MB prompt is CPU work that, on the event loop, froze every stream for the whole encode (~1.5 s per 4 MB
prompt measured before the tokenizer pool). Now it runs on a thread pool of its own (api/prompt_text.py), so streams keep
flowing. This runs `--streams` streaming completions (`--tokens` tokens each, ignore_eos) twice -- alone, and while another
client sends ~3.5 MB `/tokenize` requests back to back -- and reports the inter-token gaps the streaming clients saw (p50,
p99, max), and how many large prompts were tokenised meanwhile. Same run, same server. The ratio is "with large prompts"
over "alone"; flat means close to 1 (on a 2-core machine tokenising also takes a core from the engine, so p50 can rise).

    python benchmarks/server_big_prompts.py [--streams 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stream_gaps(base: str, tokens: int, out: list[float]) -> None:
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    last = None
    with httpx.Client(timeout=300) as client, client.stream("POST", f"{base}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if last is not None:
                out.append(now - last)
            last = now


def _round(base: str, streams: int, tokens: int, big_prompts: bool) -> tuple[list[float], int]:
    gaps: list[list[float]] = [[] for _ in range(streams)]
    stop, sent = threading.Event(), [0]

    def flood() -> None:
        big = json.dumps({"model": "tiny", "prompt": "word " * 700_000})
        with httpx.Client(timeout=300) as client:
            while not stop.is_set():
                client.post(f"{base}/tokenize", content=big, headers={"Content-Type": "application/json"})
                sent[0] += 1

    flooder = threading.Thread(target=flood) if big_prompts else None
    if flooder is not None:
        flooder.start()
        time.sleep(1.0)  # the first large prompt is being tokenised when the streams start
    workers = [threading.Thread(target=_stream_gaps, args=(base, tokens, g)) for g in gaps]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    stop.set()
    if flooder is not None:
        flooder.join()
    return [x for g in gaps for x in g], sent[0]


def _ms(values: list[float], q: float) -> float:
    return 1000 * statistics.quantiles(values, n=100)[int(q) - 1] if q < 100 else 1000 * max(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    port = _free_port()
    cmd = [sys.executable, "-m", "openk3", "serve", "--model", "tiny", "--port", str(port)]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                httpx.get(f"{base}/health", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        _round(base, 1, 4, big_prompts=False)  # warm-up
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        print(f"command: python benchmarks/server_big_prompts.py --streams {args.streams} --tokens {args.tokens}; commit {commit}\n")
        print("| round | large prompts tokenised meanwhile | ITL p50 ms | ITL p99 ms | ITL max ms |")
        print("|---|---|---|---|---|")
        rows = {}
        for name, flood in (("streams alone", False), ("with ~3.5 MB /tokenize requests", True)):
            gaps, sent = _round(base, args.streams, args.tokens, flood)
            rows[name] = [_ms(gaps, 50), _ms(gaps, 99), _ms(gaps, 100)]
            print(f"| {name} | {sent} | {rows[name][0]:.1f} | {rows[name][1]:.1f} | {rows[name][2]:.1f} |")
        alone, loaded = rows["streams alone"], rows["with ~3.5 MB /tokenize requests"]
        print(f"\nratio with/alone: p50 {loaded[0] / alone[0]:.2f}x, p99 {loaded[1] / alone[1]:.2f}x, max {loaded[2] / alone[2]:.2f}x")
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()

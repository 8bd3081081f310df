"""Serving: client-side throughput and latency percentiles of the demo model at concurrency 1, 8 and 32, over HTTP on loopback.

Run (after `make venv`, which installs the project):
    .venv/bin/python benchmarks/serve.py [--model tiny] [--concurrency 1 8 32] [--input-len 128] [--output-len 32]
                                         [--torch-threads N] [--out benchmarks/results/serve.md]
Starts `openk3 serve` in a subprocess, runs `openk3 bench serve --dataset random --max-concurrency C` at each level (seeded, greedy,
ignore_eos so every request makes exactly --output-len tokens) and prints one table. The baseline of every ratio is concurrency 1
in the same run. Correctness first: the server's greedy completion must equal the offline engine's (`LLM.generate`) for the same
model and seed, or no ratio is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
CHECK_PROMPT = "The capital of France is"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "openk3",
        "serve",
        "--model",
        args.model,
        "--port",
        str(port),
        "--seed",
        str(args.seed),
        "--max-num-seqs",
        str(max(args.concurrency)),
        "--log-level",
        "warning",
    ]
    if args.torch_threads is not None:
        cmd += ["--torch-threads", str(args.torch_threads)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"openk3 serve exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.terminate()
    raise RuntimeError("openk3 serve did not become healthy within 300 s")


def server_matches_offline(args: argparse.Namespace, base: str) -> tuple[bool, str]:
    import warnings

    import torch

    from openk3.llm import LLM
    from openk3.serve.sampling import SamplingParams

    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    r = httpx.post(
        f"{base}/v1/completions", json={"model": args.model, "prompt": CHECK_PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}, timeout=120
    ).json()
    served = r["choices"][0]["text"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offline = LLM(args.model, seed=args.seed).generate(CHECK_PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].text
    return served == offline, f"server {served!r} vs offline {offline!r}"


def bench(args: argparse.Namespace, base: str, concurrency: int) -> dict:
    num_prompts = max(args.min_prompts, args.prompts_per_slot * concurrency)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            "-m",
            "openk3",
            "bench",
            "serve",
            "--base-url",
            base,
            "--model",
            args.model,
            "--dataset",
            "random",
            "--max-concurrency",
            str(concurrency),
            "--num-prompts",
            str(num_prompts),
            "--seed",
            str(args.seed),
            "--input-len",
            str(args.input_len),
            "--output-len",
            str(args.output_len),
            "--save-result",
            str(out),
            "--disable-tqdm",
        ]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--prompts-per-slot", type=int, default=2, help="requests per concurrency level = max(min, this x concurrency)")
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None, help="also write the table (markdown) here")
    args = p.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server(args, port)
    try:
        ok, detail = server_matches_offline(args, base)
        results = [(c, bench(args, base, c)) for c in args.concurrency]
    finally:
        server.terminate()
        server.wait(timeout=60)

    import torch

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    threads = args.torch_threads if args.torch_threads is not None else torch.get_num_threads()
    lines = [
        f"# Serving: `{args.model}` over HTTP, concurrency {', '.join(map(str, args.concurrency))}",
        "",
        f"command: `.venv/bin/python benchmarks/serve.py {' '.join(sys.argv[1:])}`",
        f"torch {torch.__version__}, {platform.machine()} CPU ({os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end), "
        f"{threads} torch threads, commit {commit}",
        f"workload: random token prompts of {args.input_len} tokens, {args.output_len} output tokens each (greedy, ignore_eos), "
        f"seed {args.seed}; client-side times from `openk3 bench serve`",
        f"correctness: server greedy text == offline LLM.generate: {'yes' if ok else 'NO -- ' + detail}",
        "",
        "| concurrency | requests | failed | req/s | output tok/s | output tok/s vs c=1 | TTFT mean / median / p99 ms | TPOT median / p99 ms "
        "| ITL median / p99 ms | E2EL median / p99 ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    baseline = results[0][1]["output_throughput"]
    for c, r in results:
        ratio = f"{r['output_throughput'] / baseline:.2f}x" if ok and baseline > 0 else "n/a"
        lines.append(
            f"| {c} | {r['completed']} | {r['failed']} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {ratio} "
            f"| {r['mean_ttft_ms']:.0f} / {r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} "
            f"| {r['median_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} | {r['median_e2el_ms']:.0f} / {r['p99_e2el_ms']:.0f} |"
        )
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out is not None:
        args.out.write_text(table)
    return 0 if ok and all(r["failed"] == 0 for _, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

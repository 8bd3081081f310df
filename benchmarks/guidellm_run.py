"""guidellm end to end against `openk3 serve`: its `openai_http` backend on /v1/completions and /v1/chat/completions,
synthetic prompts, a fixed concurrency and request count; prints guidellm's own tables and one summary row per route.

guidellm is a heavy client (it pulls torch and transformers) and not a project dependency: install it into a venv of its
own and name its executable, e.g.
    python -m venv /tmp/guidellm && /tmp/guidellm/bin/pip install guidellm
    .venv/bin/python benchmarks/guidellm_run.py --guidellm /tmp/guidellm/bin/guidellm [--model tiny] [--out FILE.md]

Nothing is downloaded: guidellm's synthetic prompts are made with the served model's own tokenizer folder (for a preset,
openk3/assets/<name>), read offline. guidellm sends `stream_options.continuous_usage_stats` (usage in every chunk) and
`ignore_eos`; a run where any request errored fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lm_eval_local import ROOT, free_port, start_server  # the sibling script's server start-up (benchmarks/ is on sys.path)


def run_guidellm(exe: str, base: str, route: str, tokenizer: Path, streams: int, requests: int, out: Path) -> tuple[list[str], str]:
    cmd = [exe, "run", "--backend", f"kind=openai_http,target={base},request_format={route}"]
    cmd += ["--profile", f"kind=concurrent,streams={streams}", "--constraint", f"kind=max_requests,count={requests}"]
    cmd += ["--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16", "--tokenizer", f"kind=huggingface_auto,model={tokenizer}"]
    cmd += ["--output", f"kind=json,path={out}", "--disable-progress"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"guidellm ({route}) exited with {done.returncode}:\n{(done.stdout + done.stderr)[-4000:]}")
    return cmd, done.stdout


def summary(out: Path) -> dict[str, float]:
    (bench,) = json.loads(out.read_text())["benchmarks"]
    reqs = bench["requests"]
    ok = reqs["successful"]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "successful": len(ok),
        "errored": len(reqs["errored"]),
        "incomplete": len(reqs["incomplete"]),
        "prompt_tokens": mean([r["prompt_tokens"] for r in ok]),
        "output_tokens": mean([r["output_tokens"] for r in ok]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guidellm", required=True, help="the guidellm executable of a venv with guidellm installed")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--streams", type=int, default=2, help="guidellm's concurrency")
    p.add_argument("--requests", type=int, default=8, help="requests per route")
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    args = p.parse_args()
    preset = ROOT / "openk3" / "assets" / args.model
    tokenizer = preset if preset.is_dir() else Path(args.model)

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(args.model, args.seed, port, args.torch_threads)
    report: list[str] = []
    rows = ["| route | successful | errored | incomplete | mean prompt tokens | mean output tokens | wall s |", "|---|---|---|---|---|---|---|"]
    failed = False
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for route in ("/v1/completions", "/v1/chat/completions"):
                out = Path(tmp) / f"{route.strip('/').replace('/', '_')}.json"
                started = time.perf_counter()
                cmd, stdout = run_guidellm(args.guidellm, base, route, tokenizer, args.streams, args.requests, out)
                took = time.perf_counter() - started
                s = summary(out)
                failed |= s["errored"] > 0 or s["successful"] != args.requests
                rows.append(
                    f"| `{route}` | {s['successful']} | {s['errored']} | {s['incomplete']} | {s['prompt_tokens']:.0f} | {s['output_tokens']:.0f} | {took:.0f} |"
                )
                shown = " ".join(c.replace(str(tokenizer), "<model folder>").replace(tmp, "<tmp>").replace(str(port), "PORT") for c in cmd[1:])
                report += [f"### `{route}`", "", f"    guidellm {shown}", ""]
                report += [line for line in stdout.splitlines() if line.startswith("|") and "====" not in line] + [""]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = [
        f"## guidellm against `openk3 serve --model {args.model}`",
        "",
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; commit {commit}",
        f"command: python benchmarks/guidellm_run.py --guidellm <venv>/bin/guidellm --model {args.model} --streams {args.streams} --requests {args.requests}",
        "",
        *rows,
        "",
    ]
    text = "\n".join(head + report)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if failed:
        print("FAILED: guidellm saw errored or missing requests", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Scale-out routing: openk3's prefix-aware replica router against Ray's power-of-two-choices, on one multi-turn workload.

N replicas of the model (2 by default; each `openk3 serve --enable-prefix-caching`, --replica-cpus Ray CPUs, one torch thread) on a local Ray
cluster behind openk3's front end, deployed with `openk3.launch.replicas.replica_application` (what `openk3 serve --replicas 2
--replica-router prefix|pow2` runs). The same workload runs twice, on a fresh deployment each time: `--replica-router
prefix` (PrefixAffinityRouter) and the baseline `pow2` (Ray's default router). Both have prefix caching on in every
replica; only the routing differs, and the prefix router's cross-replica prefix pull (`--prefix-pull on`, the default:
a replica lacking a prefix the other holds pulls it, scale/prefix_pull.py; pow2 has none).

Workload: C conversations of T turns sharing one long system prompt (several 64-token match units); each turn appends the
assistant's reply and a new user message (thinking off, so each turn's prompt is a token prefix of the next one's). At
most K requests are in flight. Every request is streamed (temperature 0, ignore_eos, short max_tokens) with
`stream_options.include_usage`: TTFT is the client's time to the first chunk (the role chunk, which the server sends with
the first generated token, as vLLM does),
cached share = sum of usage.prompt_tokens_details.cached_tokens / sum of usage.prompt_tokens (cross-checked against the
replicas' `openk3:prefix_cache_hits` / `queries` counters from the front end's /metrics, differenced over the workload),
the spread over replicas is the response header `x-openk3-replica` (and the /metrics `replica` label).
Correctness gate: greedy replies must be the same under both routers (the caches must not change an answer), else no ratio.

  .venv/bin/python benchmarks/scale_routing.py                            # 8 conversations x 4 turns, 4 in flight
  .venv/bin/python benchmarks/scale_routing.py --conversations 4 --turns 2 # a quick look
  .venv/bin/python benchmarks/scale_routing.py --out benchmarks/results/scale_routing.md
  .venv/bin/python benchmarks/scale_routing.py --with-nopull               # + the prefix router without prefix pulls, same run
  .venv/bin/python benchmarks/scale_routing.py --replicas 4 --replica-cpus 0.5 --conversations 16 --in-flight 8  # a fleet of 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
SENTENCES = (
    "You are a careful assistant who answers in short sentences and keeps to the facts of the question asked.",
    "When a question is unclear, say so plainly and ask for the missing detail before you answer it.",
    "Never invent names, numbers or dates; when you do not know a thing, say that you do not know it.",
    "Write in plain words, as to a friend who is clever but new to the subject, and avoid needless jargon.",
    "Keep every answer under five sentences unless the user asks for more, and put the main point first.",
    "If the user asks for a list, give at most seven items, each on its own line, without long explanations.",
    "Treat every earlier turn of this conversation as context, and do not repeat what was already said.",
    "When you correct yourself, say what was wrong in the earlier answer and give the right one in its place.",
    "Be kind and patient with the user, and never mock a question however simple it may seem to you.",
    "Stories of the old kings, of the land and of the sea are welcome, so long as they are told truthfully.",
    "Do not give advice on medicine, law or money beyond what any careful reader of a good book would know.",
    "End each answer with nothing more: no greeting, no summary, and no offer to help further.",
)
TOPICS = ("the sea", "the harvest", "the old kings", "the river", "the mountains", "the city gates", "the wells", "the stars")
ASKS = ("Tell me about {}.", "What else is known of {}?", "Why does {} matter to the people?", "Say one more thing about {}.", "And the end of {}?")
WHO = ("my grandfather", "the old shepherd", "a traveller from the east", "the priest of the town", "my sister", "a fisherman")
SAW = ("wrote down", "told me", "used to sing", "swore", "doubted", "remembered")
WHAT = (
    "that the waters rose for forty days",
    "that the gates were of brass",
    "that the harvest failed three years running",
    "that the kings were buried by the river",
    "that the stars were counted by night",
    "that the wells ran dry in summer",
)


def user_message(c: int, t: int, sentences: int) -> str:
    """Turn t of conversation c: a few sentences of its own (so each conversation's history is its own), then a question."""
    rng = random.Random(1000 * c + t)
    told = " ".join(f"{rng.choice(WHO).capitalize()} {rng.choice(SAW)} {rng.choice(WHAT)}." for _ in range(sentences))
    return f"(conversation {c}, turn {t + 1}) {told} " + ASKS[t % len(ASKS)].format(TOPICS[c % len(TOPICS)])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    replica: str
    reply: str


@dataclass
class RouterRun:
    router: str
    turns: list[Turn] = field(default_factory=list)
    metrics_before: dict[tuple[str, str], float] = field(default_factory=dict)
    metrics_after: dict[tuple[str, str], float] = field(default_factory=dict)
    wall_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    def replies(self) -> dict[tuple[int, int], str]:
        return {(t.conversation, t.turn): t.reply for t in self.turns}

    def counter_delta(self, family: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for (name, replica), v in self.metrics_after.items():
            if name == family:
                out[replica] = v - self.metrics_before.get((name, replica), 0.0)
        return out


def parse_metrics(text: str) -> dict[str, dict[str, float]]:
    """replica label -> {sample name: value}, for the per-replica prefix-cache and request counters."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = ("openk3:prefix_cache_queries", "openk3:prefix_cache_hits", "openk3:request_success", "openk3:prompt_tokens", "openk3:prefix_cache_remote")
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(wanted) and s.name.endswith("_total") and "replica" in s.labels:
                mine = out.setdefault(s.labels["replica"], {})
                mine[s.name] = mine.get(s.name, 0.0) + s.value  # request_success has a finished_reason label too: summed
    return out


async def read_metrics(client: httpx.AsyncClient, replicas: int, tries: int = 60) -> dict[tuple[str, str], float]:
    """Every replica's counters, read while the deployment is idle (so they do not move between reads).

    Under `--replica-router pow2` the front end's per-replica report calls go through Ray's default router, which does not
    honour the call's target replica: a report that lands on the other replica fails (WrongReplicaError) and that replica
    is missing from that /metrics answer. /metrics is therefore read until each replica has answered once."""
    got: dict[str, dict[str, float]] = {}
    for _ in range(tries):
        for replica, samples in parse_metrics((await client.get("/metrics")).text).items():
            got.setdefault(replica, samples)
        if len(got) >= replicas:
            break
        await asyncio.sleep(0.2)
    return {(name, replica): v for replica, samples in got.items() for name, v in samples.items()}


async def one_turn(client: httpx.AsyncClient, args: argparse.Namespace, messages: list[dict]) -> tuple[float, dict, str, str]:
    body = {
        "model": args.model,
        "messages": messages,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "chat_template_kwargs": {"thinking": False},  # the reply is content; a turn's prompt is then a prefix of the next one's
    }
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage: dict = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        replica = r.headers.get("x-openk3-replica", "?")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"in-stream error: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if ttft is None:  # the role chunk: sent with the first generated token (as vLLM does)
                    ttft = time.perf_counter() - t0
                text.append(choice.get("delta", {}).get("content") or "")
    if ttft is None:
        raise RuntimeError("stream ended without a generated token")
    return ttft, usage, replica, "".join(text)


async def conversation(client: httpx.AsyncClient, args: argparse.Namespace, system: str, c: int, gate: asyncio.Semaphore, run: RouterRun) -> None:
    messages: list[dict] = [{"role": "system", "content": system}]
    for t in range(args.turns):
        messages.append({"role": "user", "content": user_message(c, t, args.user_sentences)})
        async with gate:
            try:
                ttft, usage, replica, reply = await one_turn(client, args, messages)
            except Exception as e:  # recorded and reported; the conversation stops there
                run.errors.append(f"conversation {c} turn {t}: {type(e).__name__}: {e}")
                return
        details = usage.get("prompt_tokens_details") or {}
        run.turns.append(Turn(c, t, ttft, int(usage.get("prompt_tokens", 0)), int(details.get("cached_tokens", 0)), replica, reply))
        messages.append({"role": "assistant", "content": reply})


async def workload(base: str, args: argparse.Namespace, system: str, run: RouterRun) -> None:
    gate = asyncio.Semaphore(args.in_flight)
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        run.metrics_before = await read_metrics(client, args.replicas)
        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(client, args, system, c, gate, run) for c in range(args.conversations)))
        run.wall_s = time.perf_counter() - t0
        run.metrics_after = await read_metrics(client, args.replicas)


def wait_healthy(base: str, replicas: int, bound_s: float) -> None:
    """Until every replica has reported healthy once (one /health answer may miss a replica under pow2: read_metrics)."""
    deadline = time.monotonic() + bound_s
    healthy: set[str] = set()
    with httpx.Client(base_url=base, timeout=30) as client:
        while True:
            try:
                r = client.get("/health")
                if r.status_code in (200, 503):
                    healthy |= {rep for rep, line in r.json().get("replicas", {}).items() if line == "health 200"}
            except httpx.HTTPError:
                pass
            if len(healthy) >= replicas:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{replicas} replicas did not report healthy within {bound_s:g} s (healthy: {sorted(healthy)})")
            time.sleep(0.5)


async def warm_up(base: str, args: argparse.Namespace) -> None:
    """A few short unrelated prompts (sharing nothing with the workload, and excluded from it by the counter
    differences), so that first-call costs (C kernels, lazy imports) are not counted as TTFT."""
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        msgs = [[{"role": "user", "content": f"Warm-up number {i}: count to three."}] for i in range(2 * args.replicas)]
        await asyncio.gather(*(one_turn(client, args, m) for m in msgs))


def run_router(label: str, args: argparse.Namespace, system: str) -> RouterRun:
    """One deployment and workload; `label`: "prefix" (pulls as --prefix-pull says), "prefix-nopull" or "pow2"."""
    from ray import serve

    from openk3.launch.replicas import replica_application
    from openk3.scale.deploy import ScaleConfig

    argv = ["--model", args.model, "--enable-prefix-caching", "--torch-threads", "1", "--max-model-len", str(args.max_model_len), "--log-level", "warning"]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    run = RouterRun(label)
    router = "pow2" if label == "pow2" else "prefix"
    try:
        pull = None if label == "pow2" else (label == "prefix" and args.prefix_pull == "on")
        config = ScaleConfig(replicas=args.replicas, router=router, replica_cpus=args.replica_cpus, max_imbalance=args.max_imbalance, prefix_pull=pull)
        serve.run(replica_application(argv, config), name="openk3", route_prefix="/")
        wait_healthy(base, args.replicas, 180)
        asyncio.run(warm_up(base, args))
        asyncio.run(workload(base, args, system, run))
    finally:
        serve.shutdown()
    return run


def summary(runs: list[RouterRun]) -> dict:
    turns = [t for run in runs for t in run.turns]
    ttft = [t.ttft_s * 1e3 for t in turns]
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    hits = sum(v for run in runs for v in run.counter_delta("openk3:prefix_cache_hits_total").values())
    queries = sum(v for run in runs for v in run.counter_delta("openk3:prefix_cache_queries_total").values())
    busiest, moved = [], 0
    for run in runs:
        spread = Counter(t.replica for t in run.turns)
        busiest.append(max(spread.values()) / len(run.turns) if run.turns else float("nan"))
        per_conv: dict[int, set[str]] = {}
        for t in run.turns:
            per_conv.setdefault(t.conversation, set()).add(t.replica)
        moved += sum(len(r) > 1 for r in per_conv.values())
    return {
        "requests": len(turns),
        "prompt": prompt,
        "share": cached / prompt if prompt else 0.0,
        "metrics_share": hits / queries if queries else float("nan"),
        "ttft_mean": statistics.fmean(ttft) if ttft else float("nan"),
        "ttft_p50": percentile(ttft, 50) if ttft else float("nan"),
        "ttft_p90": percentile(ttft, 90) if ttft else float("nan"),
        "busiest": statistics.fmean(busiest),
        "moved": moved,
        "wall": sum(run.wall_s for run in runs),
    }


def row(label: str, x: dict, base: dict | None, ok: bool, spread: str, conversations: int) -> str:
    if base is None:
        ratio = "baseline"
    else:
        ratio = f"{base['ttft_mean'] / x['ttft_mean']:.2f}x" if ok and x["ttft_mean"] > 0 else "n/a (correctness gate failed)"
    return (
        f"| {label} | {x['requests']} | {x['prompt']} | {x['share']:.1%} | {x['metrics_share']:.1%} | "
        f"{x['ttft_mean']:.0f} / {x['ttft_p50']:.0f} / {x['ttft_p90']:.0f} | {ratio} | {spread} | {x['moved']} of {conversations} | {x['wall']:.1f} |"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument(
        "--replica-cpus",
        type=float,
        default=1.0,
        help="Ray CPUs per replica (ScaleConfig.replica_cpus); the local Ray node declares max(2, ceil(replicas x this)) CPUs, "
        "so 4 replicas x 0.5 fit the 2 CPUs of a small machine (each replica runs one torch thread whatever this is)",
    )
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--user-sentences", type=int, default=3, help="sentences of a conversation's own in each user message (about 20 tokens each)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="deploy-and-run pairs (prefix, pow2; + prefix-nopull with --with-nopull), the order alternating; each on fresh deployments",
    )
    p.add_argument("--system-sentences", type=int, default=len(SENTENCES), help="sentences of the shared system prompt (about 30 tokens each)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-imbalance", type=int, default=4, help="prefix router: in-flight requests a match may cost (ScaleConfig's default: 4)")
    p.add_argument("--prefix-pull", choices=("on", "off"), default="on", help="prefix router: cross-replica prefix pulls (ScaleConfig.prefix_pull)")
    p.add_argument("--with-nopull", action="store_true", help="also run the prefix router with prefix pulls off in every repeat (what the pull adds, same run)")
    p.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    args = p.parse_args()

    import ray
    import torch

    from openk3.scale.cluster import connect
    from openk3.serve.loading import model_tokenizer

    system = " ".join(SENTENCES[: args.system_sentences])
    system_tokens = len(model_tokenizer(args.model, 0).encode(system))
    load_start = os.getloadavg()[0]
    node_cpus = max(2, math.ceil(args.replicas * args.replica_cpus))
    connect(None, num_cpus=node_cpus)
    labels = ("prefix", "pow2", "prefix-nopull") if args.with_nopull else ("prefix", "pow2")
    runs: dict[str, list[RouterRun]] = {r: [] for r in labels}
    try:
        for i in range(args.repeats):
            for r in labels if i % 2 == 0 else labels[::-1]:
                runs[r].append(run_router(r, args, system))
    finally:
        ray.shutdown()

    every = [run for rs in runs.values() for run in rs]
    reference = every[0].replies()
    same = not any(run.errors for run in every) and len(reference) == args.conversations * args.turns and all(run.replies() == reference for run in every)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.splitlines()
    if dirty:
        commit += f" + uncommitted changes in {len(dirty)} tracked files"
    n = args.conversations
    lines = [
        f"# Scale-out routing: prefix-aware vs pow2, {args.replicas} x `{args.model}` replicas on a local Ray cluster",
        "",
        f"command: `.venv/bin/python benchmarks/scale_routing.py{''.join(' ' + a for a in sys.argv[1:])}`",
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs; load average {load_start:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end), torch {torch.__version__}, ray {ray.__version__}, commit {commit}",
        f"deployment: openk3.launch.replicas.replica_application, {args.replicas} replicas x ({args.replica_cpus:g} Ray CPU, --torch-threads 1, "
        f"--enable-prefix-caching, match unit 64) on a Ray node of {node_cpus} CPUs, front end on 0 CPUs; "
        f"prefix router max_imbalance {args.max_imbalance}, prefix pull {args.prefix_pull}; every run on a fresh deployment "
        f"(serve.shutdown between), {args.repeats} {'triples' if args.with_nopull else 'pairs'}, the order alternating "
        f"({', '.join(labels)} first, then reversed, ...)",
        f"workload: {n} conversations x {args.turns} turns sharing one system prompt of {system_tokens} tokens; "
        f"each turn appends the reply and a new user message ({args.user_sentences} sentences of its own and a question; thinking off); "
        f"{args.in_flight} requests in flight; streamed, temperature 0, "
        f"ignore_eos, max_tokens {args.max_tokens}; 2 x replicas unrelated warm-up requests first (not counted)",
        "TTFT: client time to the first streamed chunk (the role chunk, sent with the first token). Cached share = sum "
        "usage.prompt_tokens_details.cached_tokens / sum usage.prompt_tokens (client side); the /metrics column is the replicas' "
        "openk3:prefix_cache_hits / queries counters, differenced over the workload",
        f"correctness: greedy replies identical in every run under both routers: {'yes' if same else 'NO'}",
        "",
        "| router | requests | prompt tokens | cached share (usage) | cached share (/metrics) | TTFT mean / p50 / p90 ms "
        "| TTFT speed-up vs pow2 (pow2 mean / this mean) | requests per replica | conversations that changed replica | wall s |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for i in range(args.repeats):
        base = summary([runs["pow2"][i]])
        for r in labels:
            run = runs[r][i]
            spread = ", ".join(f"{rep}: {k}" for rep, k in sorted(Counter(t.replica for t in run.turns).items(), key=lambda kv: -kv[1]))
            lines.append(row(f"{r}, run {i + 1}", summary([run]), None if r == "pow2" else base, same, spread, n))
    pooled = {r: summary(runs[r]) for r in runs}
    for r in labels:
        x = pooled[r]
        spread = f"busiest replica {x['busiest']:.0%} (mean of runs)"
        lines.append(row(f"**{r}, all {args.repeats} runs**", x, None if r == "pow2" else pooled["pow2"], same, spread, n * args.repeats))
    lines.append("")
    for r in labels:
        per_turn = []
        for t in range(args.turns):
            ts = [u for run in runs[r] for u in run.turns if u.turn == t]
            if ts:
                per_turn.append(
                    f"turn {t + 1}: {sum(u.cached_tokens for u in ts) / max(1, sum(u.prompt_tokens for u in ts)):.0%} cached, "
                    f"TTFT mean {statistics.fmean(u.ttft_s for u in ts) * 1e3:.0f} ms"
                )
        lines.append(f"- {r}, per turn (all runs): " + "; ".join(per_turn))
        for i, run in enumerate(runs[r]):
            done = run.counter_delta("openk3:request_success_total")  # a replica that finished nothing has no sample: 0
            replicas = sorted({rep for _, rep in run.metrics_after})
            by_metrics = ", ".join(f"{k}: {done.get(k, 0.0):.0f}" for k in replicas)
            lines.append(f"- {r}, run {i + 1}, requests per replica from /metrics (openk3:request_success): {by_metrics}")
            pulls = {k: sum(run.counter_delta(f"openk3:prefix_cache_remote_{k}_total").values()) for k in ("pulls", "pull_bytes", "pull_failures")}
            if any(pulls.values()):
                lines.append(
                    f"- {r}, run {i + 1}, cross-replica prefix pulls (/metrics openk3:prefix_cache_remote_*): {pulls['pulls']:.0f} imported, "
                    f"{pulls['pull_bytes'] / 1e3:.0f} kB, {pulls['pull_failures']:.0f} that brought nothing"
                )
            for e in run.errors:
                lines.append(f"- {r}, run {i + 1}, ERROR: {e}")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out is not None:
        args.out.write_text(report)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

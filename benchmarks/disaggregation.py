"""Prefill/decode disaggregation vs aggregated serving, TTFT and ITL at the same load -- at the ENGINE level.

Not the Ray prefill and decode pools (`openk3 serve --prefill-replicas`, docs/scale-out.md): this measures the hand-off
protocol of serve/cache/handoff.py between LLMEngines, each in its own process on one torch thread (processes, not threads: at these
sizes an engine step is mostly Python, and two engine threads would share one GIL). The transport is a multiprocessing
queue (a local pipe): no network, no serialisation beyond the record itself.

- aggregated xK: K LLMEngines, each doing prefill and decode; requests go to the engine with the fewest in flight.
- disaggregated 1P1D: a prefill engine runs P[:-1] (max_tokens 1; the token is discarded) and exports the snapshot at
  len(P) - 1 (`LLMEngine.export_prefix`); the decode engine imports the record (`import_prefix`) and serves P: it hits
  at len(P) - 1, computes P[-1] and decodes.
Load: a closed loop of C requests in flight over the same N prompts, the same max_tokens (greedy, ignore_eos) in every
setup. TTFT is admission -> first token (for disaggregated: prefill (with its queueing) + export + the pipe and the wait
for the decode engine's current step + import + first decode step, each reported); ITL is the gap between consecutive
tokens of a request. 1P1D uses two engines: aggregated x2 is the same compute, aggregated x1 one engine's worth.
Correctness gate: every setup's greedy token ids equal aggregated x1's, and every decode-side request hit at len(P) - 1;
else no ratio is reported. Bytes: each record's length and payload, against the planner's transfer bytes
(planner/disagg.py `transfer`) for len(P) - 1 tokens (what the record holds) and len(P) (what the planner prices).

  .venv/bin/python benchmarks/disaggregation.py                     # tiny, 16 prompts of 150-400 tokens, C = 1 and 4
  .venv/bin/python benchmarks/disaggregation.py --model debug --requests 4
  .venv/bin/python benchmarks/disaggregation.py --out benchmarks/results/disaggregation.md
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import queue
import random
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from openk3.launch.engine import build_engine
from openk3.launch.spec import EngineSpec
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.runner import CausalLM
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
PAGE = 64


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def build(model: str, seed: int) -> tuple[CausalLM, Tokenizer]:
    from openk3.serve.loading import build_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return build_model(model, torch.float32, "cpu", seed)


@dataclass
class Serving:
    """A request this worker serves to the end (aggregated, or the decode side of a hand-off)."""

    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    handoff: dict[str, float] = field(default_factory=dict)  # prefill_done, exported (from the prefill worker), import_start, imported
    boundary: int = 0


def worker(index: int, commands: list, results, model_name: str, seed: int, engine_cfg: EngineConfig) -> None:
    """One engine in its own process: runs the commands it is sent between steps, and steps while work is pending.

    Commands: ("reset",) a fresh engine (empty caches) and a warm-up request; ("add", rid, prompt, max_tokens) serve a request;
    ("prefill", rid, prompt, max_tokens, target) compute prompt[:-1], export the snapshot at len(prompt) - 1 and send it to
    worker `target` as ("handoff", rid, record, prompt, max_tokens, times); ("check",) the engine's invariants; ("stop",).
    Results: (index, "ready"), (index, "checked", CPU seconds since the reset) and
    (index, "finished", rid, tokens, token times, cached, handoff times, boundary)."""
    try:
        torch.set_num_threads(1)
        model, tokenizer = build(model_name, seed)
        engine: LLMEngine | None = None
        cpu0 = 0.0
        serving: dict[str, Serving] = {}
        prefilling: dict[str, tuple[list[int], int, int]] = {}  # engine request id -> prompt, max_tokens, target worker
        inbox = commands[index]
        while True:
            block = engine is None or not engine.has_unfinished()
            try:
                while True:
                    cmd = inbox.get(block=block)
                    block = False
                    kind = cmd[0]
                    if kind == "stop":
                        return
                    if kind == "reset":
                        if engine is not None:
                            engine.close()
                        engine = build_engine(EngineSpec(cast(torch.nn.Module, model), engine_cfg, tokenizer=tokenizer)).local
                        engine.add_request("warm-up", list(range(5, 105)), greedy(4))
                        while engine.has_unfinished():
                            engine.step()
                        cpu0 = time.process_time()
                        results.put((index, "ready"))
                        continue
                    assert engine is not None, "reset first"
                    if kind == "add":
                        _, rid, prompt, max_tokens = cmd
                        serving[rid] = Serving()
                        engine.add_request(rid, prompt, greedy(max_tokens))
                    elif kind == "prefill":
                        _, rid, prompt, max_tokens, target = cmd
                        prefilling["p" + rid] = (prompt, max_tokens, target)
                        engine.add_request("p" + rid, prompt[:-1], greedy(1))  # the sampled token is discarded
                    elif kind == "handoff":
                        _, rid, record, prompt, max_tokens, times = cmd
                        s = serving[rid] = Serving(handoff=dict(times, import_start=time.perf_counter()))
                        s.boundary = engine.import_prefix(record)
                        engine.add_request(rid, prompt, greedy(max_tokens))
                        s.handoff["imported"] = time.perf_counter()
                    elif kind == "check":
                        engine.check_integrity()
                        results.put((index, "checked", time.process_time() - cpu0))  # CPU seconds since the reset
            except queue.Empty:
                pass
            if engine is None or not engine.has_unfinished():
                continue
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                if out.request_id in prefilling:
                    if out.finish_reason is None:
                        continue
                    prompt, max_tokens, target = prefilling.pop(out.request_id)
                    record = engine.export_prefix(prompt[:-1])  # right after the step that finished it: nothing evicted it yet
                    exported = time.perf_counter()
                    if record is None:
                        raise RuntimeError(f"no snapshot at boundary {len(prompt) - 1} to export (too few snapshot slots?)")
                    from openk3.serve.cache import tier_record

                    times = {"prefill_done": now, "exported": exported, "record": len(record), "payload": tier_record.decode(record).nbytes}
                    commands[target].put(("handoff", out.request_id[1:], record, prompt, max_tokens, times))
                elif out.request_id in serving:
                    s = serving[out.request_id]
                    s.tokens.extend(out.new_token_ids)
                    s.times.extend([now] * len(out.new_token_ids))
                    if out.finish_reason is not None:
                        del serving[out.request_id]
                        results.put((index, "finished", out.request_id, s.tokens, s.times, out.num_cached_tokens, s.handoff, s.boundary))
    except BaseException:
        results.put((index, "error", traceback.format_exc()))


@dataclass
class Timeline:
    """One request as the client saw it; times are time.perf_counter() (CLOCK_MONOTONIC: one clock for all processes)."""

    admitted: float = 0.0
    tokens: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    cached: int = 0
    handoff: dict[str, float] = field(default_factory=dict)
    boundary: int = 0

    @property
    def ttft(self) -> float:
        return self.times[0] - self.admitted

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.times, self.times[1:], strict=False)]


class Workers:
    def __init__(self, n: int, args: argparse.Namespace, engine_cfg: EngineConfig) -> None:
        ctx = mp.get_context("spawn")
        self.commands = [ctx.Queue() for _ in range(n)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=worker, args=(i, self.commands, self.results, args.model, args.seed, engine_cfg), daemon=True) for i in range(n)]
        for proc in self.procs:
            proc.start()
        self.bound_s = args.bound_s

    def get(self) -> tuple:
        try:
            msg = self.results.get(timeout=self.bound_s)
        except queue.Empty:
            raise RuntimeError(f"no word from the workers within {self.bound_s:g} s") from None
        if msg[1] == "error":
            raise RuntimeError(f"worker {msg[0]} failed:\n{msg[2]}")
        return msg

    def all(self, used: list[int], command: tuple, answer: str) -> list[tuple]:
        for i in used:
            self.commands[i].put(command)
        msgs = [self.get() for _ in used]
        assert all(m[1] == answer for m in msgs), msgs
        return msgs

    def stop(self) -> None:
        for q in self.commands:
            q.put(("stop",))
        for proc in self.procs:
            proc.join(timeout=30)


def run_setup(w: Workers, disaggregated: bool, engines: int, prompts: list[list[int]], concurrency: int, max_tokens: int) -> tuple[list[Timeline], float]:
    """A closed loop: request i is admitted once fewer than `concurrency` are in flight. Aggregated: to the engine with the
    fewest in flight. Disaggregated: worker 0 prefills and hands off to worker 1, which decodes. Returns the timelines and
    the engine processes' CPU seconds."""
    used = [0, 1] if disaggregated else list(range(engines))
    w.all(used, ("reset",), "ready")
    timelines = [Timeline() for _ in prompts]
    load = dict.fromkeys(used, 0)
    where: dict[str, int] = {}
    nxt, done = 0, 0

    def admit(i: int) -> None:
        rid = f"r{i}"
        timelines[i].admitted = time.perf_counter()
        if disaggregated:
            w.commands[0].put(("prefill", rid, prompts[i], max_tokens, 1))
            where[rid] = 1
        else:
            k = min(used, key=lambda j: load[j])
            load[k] += 1
            where[rid] = k
            w.commands[k].put(("add", rid, prompts[i], max_tokens))

    while nxt < min(concurrency, len(prompts)):
        admit(nxt)
        nxt += 1
    while done < len(prompts):
        _, kind, rid, tokens, times, cached, handoff, boundary = w.get()
        assert kind == "finished"
        t = timelines[int(rid[1:])]
        t.tokens, t.times, t.cached, t.handoff, t.boundary = tokens, times, cached, handoff, boundary
        if not disaggregated:
            load[where[rid]] -= 1
        done += 1
        if nxt < len(prompts):
            admit(nxt)
            nxt += 1
    cpu = sum(m[2] for m in w.all(used, ("check",), "checked"))
    return timelines, cpu


def planner_bytes(config, tokens: int, cache_bytes: int) -> float:
    from openk3.planner.disagg import transfer
    from openk3.planner.hardware import load_catalogue
    from openk3.planner.inputs import Layout, Quantisation, Workload
    from openk3.planner.perf import Scenario

    one = Layout(1)
    q = Quantisation(cache_dtype_bytes=cache_bytes, state_dtype_bytes=4)
    sc = Scenario(config, q, one, Workload(context=tokens, concurrency=1), load_catalogue().system("gb300-nvl72"))
    return transfer(sc, tokens, one, one, inside_domain=True).bytes


def ms(xs: list[float], tail: float, digits: int) -> str:
    """mean / median / the `tail` quantile (nearest rank), in milliseconds with `digits` decimals; "-" for none."""
    if not xs:
        return "-"
    s = sorted(xs)
    q = s[min(len(s) - 1, round(tail * (len(s) - 1)))]
    return " / ".join(f"{v * 1e3:.{digits}f}" for v in (statistics.fmean(xs), statistics.median(xs), q))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny (the embedded checkpoint) or debug (random weights)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--min-len", type=int, default=150)
    p.add_argument("--max-len", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bound-s", type=float, default=300.0, help="a worker silent for longer fails the run")
    p.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    args = p.parse_args()

    model, _ = build(args.model, args.seed)  # here only for its config and cache dtype; the workers build their own
    cfg = model.config
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(5, cfg.vocab_size) for _ in range(rng.randrange(args.min_len, args.max_len + 1))] for _ in range(args.requests)]
    most = max(args.concurrency)
    engine_cfg = EngineConfig(
        page_size=PAGE,
        num_pages=(most + 2) * (-(-(args.max_len + args.max_tokens) // PAGE)) + 8,
        max_num_seqs=most,
        max_model_len=args.max_len + args.max_tokens,
        long_prefill_token_threshold=256,
        enable_prefix_caching=True,
        num_snapshot_slots=2 * most + 4,
        pack_cpu_weights=False,
    )
    cache_bytes = next(model.parameters()).element_size()  # the engine's cache dtype is the model's parameter dtype

    w = Workers(2, args, engine_cfg)
    setups: list[tuple[str, int, int, list[Timeline]]] = []
    cpu: list[float] = []
    load_start = os.getloadavg()[0]
    try:
        for c in args.concurrency:
            for name, dis, engines in (("aggregated x1", False, 1), ("aggregated x2", False, 2), ("disaggregated 1P1D", True, 2)):
                tl, seconds = run_setup(w, dis, engines, prompts, c, args.max_tokens)
                setups.append((name, c, engines, tl))
                cpu.append(seconds)
    finally:
        w.stop()

    reference = [t.tokens for t in setups[0][3]]
    same = all([t.tokens for t in tl] == reference for _, _, _, tl in setups)
    hits = all(t.cached == len(prompts[i]) - 1 == t.boundary for name, _, _, tl in setups if name.startswith("dis") for i, t in enumerate(tl))
    ok = same and hits
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True).stdout.splitlines()
    if dirty:
        commit += f" + uncommitted changes in {len(dirty)} tracked files"
    lens = [len(x) for x in prompts]
    lines = [
        f"# Prefill/decode disaggregation vs aggregated, engine level (`{args.model}`)",
        "",
        "ENGINE LEVEL ONLY: this does not use the Ray prefill/decode pools (`openk3 serve --prefill-replicas`). Each engine runs",
        "in its own process on one torch thread; a record goes from the prefill process to the decode process through a",
        "multiprocessing queue (a local pipe).",
        "",
        f"command: `.venv/bin/python benchmarks/disaggregation.py{''.join(' ' + a for a in sys.argv[1:])}`",
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs; load average {load_start:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end), "
        f"torch {torch.__version__}, 1 torch thread per engine process, commit {commit}",
        f"workload: {args.requests} random-token prompts of {min(lens)}-{max(lens)} tokens (mean {statistics.fmean(lens):.0f}), "
        f"{args.max_tokens} output tokens each (greedy, ignore_eos); closed loop at concurrency {', '.join(map(str, args.concurrency))}; "
        f"engines: page {PAGE}, prefill chunks of 256, prefix caching on in every setup (the hand-off needs it), fp32, no weight "
        "packing; every setup starts from fresh engines (empty caches) after a warm-up request",
        f"correctness: token ids equal to aggregated x1 in every setup: {'yes' if same else 'NO'}; "
        f"every decode-side request hit at len(P) - 1: {'yes' if hits else 'NO'}",
        "",
        "| setup | concurrency | engines (1 CPU thread each) | TTFT mean / p50 / p90 ms | TTFT vs aggregated x1 | ITL mean / p50 / p99 ms "
        "| ITL vs aggregated x1 | wall s | cores the engines got (CPU s / wall s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    base: dict[int, tuple[float, float]] = {}
    for (name, c, engines, tl), seconds in zip(setups, cpu, strict=True):
        ttft = [t.ttft for t in tl]
        itl = [x for t in tl for x in t.itl]
        wall = max(t.times[-1] for t in tl) - min(t.admitted for t in tl)
        if name == "aggregated x1":
            base[c] = (statistics.fmean(ttft), statistics.fmean(itl))
            rt = ri = "baseline"
        elif ok:
            rt, ri = f"{base[c][0] / statistics.fmean(ttft):.2f}x", f"{base[c][1] / statistics.fmean(itl):.2f}x"
        else:
            rt = ri = "n/a (correctness gate failed)"
        lines.append(f"| {name} | {c} | {engines} | {ms(ttft, 0.9, 0)} | {rt} | {ms(itl, 0.99, 1)} | {ri} | {wall:.2f} | {seconds / wall:.2f} |")
    lines += [
        "",
        "Ratios: aggregated x1's mean / this mean at the same concurrency (above 1: faster). 1P1D uses two engines: aggregated x2 is",
        "the same compute; aggregated x1 is half of it.",
        "",
        "Disaggregated TTFT broken down (means, ms):",
        "",
        "| concurrency | prefill P[:-1] (incl. queueing) | export | pipe + wait for the decode step | import + add | first decode step | TTFT |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, c, _, tl in setups:
        if name.startswith("dis"):
            h = [t.handoff for t in tl]
            parts = [
                [x["prefill_done"] - t.admitted for x, t in zip(h, tl, strict=True)],
                [x["exported"] - x["prefill_done"] for x in h],
                [x["import_start"] - x["exported"] for x in h],
                [x["imported"] - x["import_start"] for x in h],
                [t.times[0] - x["imported"] for x, t in zip(h, tl, strict=True)],
                [t.ttft for t in tl],
            ]
            lines.append(f"| {c} | " + " | ".join(f"{statistics.fmean(x) * 1e3:.1f}" for x in parts) + " |")
    first_split = next(tl for name, _, _, tl in setups if name.startswith("dis"))
    lines += [
        "",
        f"Hand-off bytes per request (record = header + payload; planner: planner/disagg.py transfer() for this config, cache dtype "
        f"{cache_bytes} B, KDA state fp32):",
        "",
        "| prompt P | boundary | record bytes | payload bytes | planner bytes at len(P) - 1 | payload == planner? | planner bytes at len(P) "
        "| planner - payload |",
        "|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for i, t in enumerate(first_split):
        n = len(prompts[i])
        at_b, at_p = planner_bytes(cfg, n - 1, cache_bytes), planner_bytes(cfg, n, cache_bytes)
        payload = int(t.handoff["payload"])
        lines.append(
            f"| {n} | {t.boundary} | {int(t.handoff['record']):,} | {payload:,} | {at_b:,.0f} | {'yes' if at_b == payload else 'NO'} | "
            f"{at_p:,.0f} | {at_p - payload:,.0f} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out is not None:
        args.out.write_text(report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

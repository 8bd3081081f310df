"""Rollout figures: episodes per minute with tool latency in the loop, and what a branch costs against replaying the episode.

Medians of `--repeats` runs, the compared rows interleaved in every repeat. Model: the `debug` preset (random init, byte
tokenizer), fp32 on the CPU; a regex grammar makes every reply the tool call
`<bash>echo N</bash>`, so every episode runs its full turn count. Tools run in real openk3 sandboxes (SandboxService in this
process; needs root and namespaces), with a fixed latency added to every call (a slow tool: a test suite, a web fetch).

1. Rollouts per minute, same engine settings, two runners interleaved per latency:
   - lockstep (rl/episode.py run_group, one group after another): a group's branches take each turn together, their tools
     run one after another, and the engine idles while they run;
   - async (rl/async_episode.py run_groups_async over one AsyncEngine): every branch of every group is its own task, tools
     run on threads, and the engine decodes other episodes while one waits for its tool.
   Engine utilisation = time inside engine steps / wall time. Gate: every episode ran all its turns with status ok.
2. A branch (rl/branching.py run_branched: trunk `--branch-at` turns, then fork into `--branches`) against replaying:
   - fork: snapshot + fork of the trunk's sandbox; replay: for each branch, a fresh sandbox set up and the trunk's tool
     calls run again (what rebuilding the state at the branch point costs without a fork);
   - prefill at the branch point: just before the branches' first replies, one batched generate of a single token over
     every branch's context (the trunk), with the prefix cache (the trunk's context is a hit) and without it (the whole
     context computed again), and with `return_routing` (exact R3 refuses hits, so it computes it all too:
     docs/rollouts.md).
   Gate: the branches' replies are the same token ids in every mode (greedy), else no ratio is printed.

  sudo python benchmarks/rollouts.py
  sudo python benchmarks/rollouts.py --latencies 0 0.5 --groups 3 --group-size 4 --turns 3
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.rl.async_episode import run_groups_async
from openk3.rl.async_policy import AsyncEnginePolicy
from openk3.rl.branching import run_branched
from openk3.rl.episode import Task, run_group
from openk3.rl.policy import Context, LLMPolicy, Reply
from openk3.rl.trajectory import ToolStatus, Trajectory
from openk3.sandbox.api.service import SandboxService
from openk3.sandbox.linux.host import probe
from openk3.sandbox.namespace.settings import BackendConfig
from openk3.serve.async_engine import AsyncEngine
from openk3.serve.sampling import SamplingParams
from openk3.serve.structured.compiler import GrammarCompiler
from openk3.serve.structured.spec import StructuredOutputs
from openk3.serve.tokenizer import ByteTokenizer

SHORT = "Echo a digit with the shell tool.\n"
LONG = "You are in a repository with a failing test. Read the code, find the bug, fix it and run the tests.\n" * 16  # ~1.6k tokens


def ok(sandboxes: Any, sandbox_id: str) -> float:
    return 1.0 if sandboxes.exec(sandbox_id, "true", timeout_s=30).exit_code == 0 else 0.0


class SlowTools:
    """Sandboxes whose every exec first waits `latency_s` (a slow tool); everything else is the service's own."""

    def __init__(self, inner: SandboxService, latency_s: float) -> None:
        self.inner = inner
        self.latency_s = latency_s

    def exec(self, sandbox_id: str, cmd: str | list[str], timeout_s: float = 60.0) -> Any:
        time.sleep(self.latency_s)
        return self.inner.exec(sandbox_id, cmd, timeout_s=timeout_s)

    def create(self, *args: Any, **kwargs: Any) -> str:
        return self.inner.create(*args, **kwargs)

    def snapshot(self, source_id: str) -> Any:
        return self.inner.snapshot(source_id)

    def fork(self, source_id: str, n: int) -> list[str]:
        return self.inner.fork(source_id, n)

    def destroy(self, target_id: str) -> None:
        self.inner.destroy(target_id)

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.inner.delete_snapshot(snapshot_id)


class StepTimer:
    """Seconds spent inside the engine's steps (wraps the instance's `step`)."""

    def __init__(self, llm: LLM) -> None:
        self.step = llm.engine.step
        self.busy = 0.0
        llm.engine.step = self  # type: ignore[method-assign]  # the benchmark times the engine's own step

    def __call__(self) -> Any:
        start = time.perf_counter()
        try:
            return self.step()
        finally:
            self.busy += time.perf_counter() - start


class ProbedPolicy:
    """An LLMPolicy that, before the call of turn `probe_turn`, times the prefill of that call's contexts alone: one batched
    generate of a single token each (the cached prompt tokens each got, and the seconds)."""

    def __init__(self, inner: LLMPolicy, probe_turn: int) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.probe_turn = probe_turn
        self.prefill_s = 0.0
        self.cached: list[int] = []

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def reply(self, contexts: Sequence[Context], turn: int) -> list[Reply]:
        if turn == self.probe_turn:
            one = dataclasses.replace(self.inner.params, max_tokens=1)
            start = time.perf_counter()
            outs = self.inner.llm.generate([list(c.token_ids) for c in contexts], one)
            self.prefill_s = time.perf_counter() - start
            self.cached = [o.num_cached_tokens for o in outs]
        return self.inner.reply(contexts, turn)


def engine(model: K3ForCausalLM, caching: bool) -> LLM:
    return LLM(copy.deepcopy(model), ByteTokenizer(256), enable_prefix_caching=caching, page_size=16, num_pages=2048, max_num_seqs=16, max_model_len=4096)


def complete(trajectories: list[Trajectory], turns: int) -> bool:
    return all(len(t.turns) == turns and all(u.status == ToolStatus.OK for u in t.turns) for t in trajectories)


def lockstep(model: K3ForCausalLM, tools: SlowTools, params: SamplingParams, groups: int, size: int, turns: int) -> tuple[float, float, bool]:
    llm = engine(model, True)
    timer = StepTimer(llm)
    task = Task("echo", SHORT, ok)
    start = time.perf_counter()
    out = [t for _ in range(groups) for t in run_group(task, LLMPolicy(llm, params), tools, size, turns)]
    wall = time.perf_counter() - start
    llm.close()
    return 60 * len(out) / wall, timer.busy / wall, complete(out, turns)


def concurrent(model: K3ForCausalLM, tools: SlowTools, params: SamplingParams, groups: int, size: int, turns: int) -> tuple[float, float, bool]:
    llm = engine(model, True)
    timer = StepTimer(llm)
    tasks = [Task(f"echo{g}", SHORT, ok) for g in range(groups)]

    async def main() -> Any:
        frontend = AsyncEngine(llm.engine)
        frontend.start()
        try:
            return await run_groups_async(tasks, AsyncEnginePolicy(frontend, params), tools, size, turns)
        finally:
            await frontend.shutdown()

    start = time.perf_counter()
    rollouts = asyncio.run(main())
    wall = time.perf_counter() - start
    llm.close()
    good = not rollouts.dropped and len(rollouts.trajectories) == groups * size and complete(rollouts.trajectories, turns)
    return 60 * len(rollouts.trajectories) / wall, timer.busy / wall, good


def replay_sandboxes(sandboxes: SandboxService, task: Task, commands: list[str], n: int) -> float:
    """Seconds to rebuild `n` sandboxes at the branch point without a fork: set up, then the trunk's calls again."""
    start = time.perf_counter()
    made = []
    for _ in range(n):
        sid = sandboxes.create()
        made.append(sid)
        if task.setup is not None:
            sandboxes.exec(sid, task.setup, timeout_s=60)
        for command in commands:
            sandboxes.exec(sid, command, timeout_s=60)
    seconds = time.perf_counter() - start
    for sid in made:
        sandboxes.destroy(sid)
    return seconds


def branch_cost(model: K3ForCausalLM, sandboxes: SandboxService, params: SamplingParams, n: int, branch_at: int, turns: int, repeats: int) -> list[str]:
    task = Task("long", LONG, ok, setup="mkdir -p /work && echo start > /work/log")
    modes = ("prefix hit", "no prefix cache", "return_routing")
    prefill: dict[str, list[float]] = {m: [] for m in modes}
    cached: dict[str, list[int]] = {m: [] for m in modes}
    forks, rebuilds, same, shared, calls = [], [], True, 0, 0
    for _ in range(repeats):  # the modes interleaved, a fresh engine each
        groups = {}
        for mode in modes:
            llm = engine(model, caching=mode != "no prefix cache")
            policy = ProbedPolicy(LLMPolicy(llm, params, return_routing=mode == "return_routing"), branch_at)
            groups[mode] = run_branched(task, policy, sandboxes, branch_at, n, turns)
            llm.close()
            prefill[mode].append(policy.prefill_s)
            cached[mode] += policy.cached
        hit = groups["prefix hit"]
        shared = hit.shared_tokens
        forks.append(hit.fork_s or 0.0)
        commands = [u.command for u in hit.trajectories[0].turns[:branch_at] if u.command is not None]
        calls = len(commands)
        rebuilds.append(replay_sandboxes(sandboxes, task, commands, n))
        want = [list(t.token_ids) for t in hit.trajectories]
        same = same and all([list(t.token_ids) for t in g.trajectories] == want for g in groups.values())
    med = {m: statistics.median(v) for m, v in prefill.items()}
    rows = []
    for mode in modes:
        ratio = f"{med['no prefix cache'] / med[mode]:.2f}x" if same else "FAIL (replies differ)"
        rows.append(f"| {mode} | {shared} | {statistics.mean(cached[mode]):.0f} | {1000 * med[mode]:.0f} | {ratio} |")
    fork_s, rebuild_s = statistics.median(forks), statistics.median(rebuilds)
    rows += ["", "| sandbox state at the branch point | ms for all branches | vs fork |", "|---|---:|---:|"]
    rows.append(f"| fork (snapshot + fork of the trunk's sandbox) | {1000 * fork_s:.1f} | 1.00x |")
    rows.append(f"| replay (fresh sandbox, setup, the trunk's {calls} calls again, per branch) | {1000 * rebuild_s:.1f} | {rebuild_s / fork_s:.2f}x |")
    branch, replay = fork_s + med["prefix hit"], rebuild_s + med["no prefix cache"]
    verdict = f"{replay / branch:.2f}x" if same else "FAIL (replies differ)"
    rows += ["", "| a branch point for all branches | ms | vs branch |", "|---|---:|---:|"]
    rows.append(f"| branch: fork + prefill with the prefix hit | {1000 * branch:.0f} | 1.00x |")
    rows.append(f"| replay from the start: sandboxes rebuilt + the whole context prefilled | {1000 * replay:.0f} | {verdict} |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latencies", type=float, nargs="+", default=[0.0, 0.5], help="seconds added to every tool call")
    p.add_argument("--groups", type=int, default=3)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--branches", type=int, default=4)
    p.add_argument("--branch-at", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="runs of each row, interleaved; the median is reported")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: small matmuls on shared cores run fastest alone)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    reason = probe().unavailable_reason
    if reason:
        raise SystemExit(f"rollouts benchmark: namespace sandboxes unavailable: {reason}")
    model = K3ForCausalLM(debug())
    model.init_weights(seed=0)
    model.eval()
    tok = ByteTokenizer(256)
    grammar = GrammarCompiler(tok, 256).compile(StructuredOutputs(regex=r"<bash>echo [0-9]</bash>"))
    params = SamplingParams(temperature=1.0, max_tokens=32, seed=None, structured_outputs=grammar, stop=("</bash>",), include_stop_str_in_output=True)
    greedy = SamplingParams(temperature=0, max_tokens=32, structured_outputs=grammar, stop=("</bash>",), include_stop_str_in_output=True)
    sandboxes = SandboxService(BackendConfig(state_dir=tempfile.mkdtemp(prefix="openk3-rollouts-", dir="/tmp"), cache_dir=tempfile.mkdtemp()))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    flags = f"--latencies {' '.join(f'{x:g}' for x in args.latencies)} --groups {args.groups} --group-size {args.group_size} --turns {args.turns}"
    flags += f" --branches {args.branches} --branch-at {args.branch_at} --repeats {args.repeats} --threads {args.threads}"
    print(f"command: python benchmarks/rollouts.py {flags}")
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; commit {commit}")
    print()
    print(f"{args.groups} groups x {args.group_size} episodes x {args.turns} turns, a tool call every turn")
    print()
    print("| tool latency s | runner | rollouts/min | engine busy | async / lockstep |")
    print("|---:|---|---:|---:|---:|")
    try:
        lockstep(model, SlowTools(sandboxes, 0.0), params, 1, 1, 1)  # warm-up, untimed: kernels, the grammar's first use
        for latency in args.latencies:
            tools = SlowTools(sandboxes, latency)
            runs: dict[str, list[tuple[float, float, bool]]] = {"lockstep": [], "async": []}
            for _ in range(args.repeats):  # interleaved
                runs["lockstep"].append(lockstep(model, tools, params, args.groups, args.group_size, args.turns))
                runs["async"].append(concurrent(model, tools, params, args.groups, args.group_size, args.turns))
            rate = {k: statistics.median(r[0] for r in v) for k, v in runs.items()}
            busy = {k: statistics.median(r[1] for r in v) for k, v in runs.items()}
            good = all(r[2] for v in runs.values() for r in v)
            ratio = f"{rate['async'] / rate['lockstep']:.2f}x" if good else "FAIL (an episode did not run all its turns)"
            print(f"| {latency:g} | lockstep | {rate['lockstep']:.1f} | {100 * busy['lockstep']:.0f}% | 1.00x |", flush=True)
            print(f"| {latency:g} | async | {rate['async']:.1f} | {100 * busy['async']:.0f}% | {ratio} |", flush=True)
        print()
        print(f"branch at turn {args.branch_at} into {args.branches} branches, greedy; prefill = one token for every branch's context, one batch")
        print()
        print("| engine | shared tokens | cached tokens per branch | prefill at the branch point ms | speed-up vs no prefix cache |")
        print("|---|---:|---:|---:|---:|")
        for row in branch_cost(model, sandboxes, greedy, args.branches, args.branch_at, args.turns, args.repeats):
            print(row, flush=True)
    finally:
        sandboxes.close()


if __name__ == "__main__":
    main()

"""`openk3 rollout`: run N episodes of a task (a JSON task file, rl/task_file.py) against an engine -- built in this process
from `--model` and the engine flags, or served at `--url` -- with tools in openk3 sandboxes (in this process, or a sandbox
server at `--sandbox-url`), and write the trajectories as JSON lines (token ids, loss mask, logprobs, routed experts with
`--routing`, rewards, weight versions). Episodes run a group at a time: `--group G` forks the task's snapshot into G samples,
and `--branch-at T` runs one trunk T turns and forks it into G branches (rl/branching.py). A group whose engine took new
weights mid-way is dropped and counted, never written. The Python API (rl/episode.py, rl/branching.py,
rl/async_episode.py) is the interface for a trainer in the same process; this command is for one served elsewhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from openk3.launch.flags import add_engine_arguments, engine_configs

ENGINE_FLAGS_NOT_TAKEN = ("seed",)  # --seed here is the sampling seed


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("rollout", help="run agent episodes of a task in sandboxes and write trajectories (JSONL)")
    p.add_argument("--task", type=Path, required=True, help="task file: {task_id, prompt, setup?, verify, documents?} (rl/task_file.py)")
    p.add_argument("--episodes", type=int, default=8, help="trajectories to write (rounded up to whole groups)")
    p.add_argument("--group", type=int, default=1, help="samples per group, forked from one snapshot (a GRPO group)")
    p.add_argument("--branch-at", type=int, default=None, help="run one trunk this many turns, then fork it into --group branches")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--tool-timeout-s", type=float, default=30.0)
    p.add_argument("--out", type=Path, required=True, help="JSONL file of trajectories (one per line)")
    p.add_argument("--routing", action="store_true", help="record each token's routed experts (R3) in the trajectories")
    p.add_argument("--url", default=None, help="a served openk3 engine (else one is built here from --model)")
    p.add_argument("--api-key", default=None, help="the server's API key, with --url")
    p.add_argument("--model", default="debug", help="preset or checkpoint folder (with --url: the served one, for its tokenizer)")
    p.add_argument("--sandbox-url", default=None, help="an openk3 sandbox server (else a sandbox service runs in this process)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (each request seeds its own generator: a group's samples come out the same)")
    p.add_argument("--stop", action="append", default=None, help="a stop string; repeatable (default: </bash>, </search>, </open>, kept in the reply)")
    add_engine_arguments(p, exclude=ENGINE_FLAGS_NOT_TAKEN)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        check_args(args)
        summary = rollout(args)
    except (ValueError, OSError) as e:
        print(f"openk3 rollout: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


def check_args(args: argparse.Namespace) -> None:
    for name in ("episodes", "group", "max_turns"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)}: expected >= 1")
    if args.branch_at is not None and not 0 < args.branch_at < args.max_turns:
        raise ValueError(f"--branch-at={args.branch_at}: expected 0 < branch-at < --max-turns ({args.max_turns})")


def rollout(args: argparse.Namespace, sandboxes: Any = None, policy: Any = None) -> dict[str, Any]:
    """Run the episodes and write them; the summary printed. `sandboxes` / `policy`: given by a caller that made its own
    (tests), else made from the flags and closed here."""
    from openk3.rl.task_file import load_task
    from openk3.rl.tools import STOP_STRINGS
    from openk3.serve.sampling import SamplingParams

    task = load_task(args.task)
    stop = tuple(args.stop) if args.stop is not None else STOP_STRINGS
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed, stop=stop, include_stop_str_in_output=True)
    closers: list[Any] = []
    try:
        if sandboxes is None:
            sandboxes = _sandboxes(args.sandbox_url)
            closers.append(sandboxes)
        if policy is None:
            policy = _policy(args, params)
            closers.append(policy)
        return _run_groups(args, task, policy, sandboxes)
    finally:
        for thing in reversed(closers):
            thing.close()


def _sandboxes(url: str | None) -> Any:
    if url is not None:
        from openk3.sandbox.api.client import SandboxClient

        return SandboxClient(url)
    from openk3.sandbox.api.service import SandboxService

    return SandboxService()


class _LocalPolicy:
    """LLMPolicy over an engine built here, closed with it."""

    def __init__(self, args: argparse.Namespace, params: Any) -> None:
        from openk3.llm import LLM
        from openk3.rl.policy import LLMPolicy

        config, parallel = engine_configs(args, exclude=ENGINE_FLAGS_NOT_TAKEN)
        self.llm = LLM(args.model, config=config, parallel=parallel)
        self.inner = LLMPolicy(self.llm, params, return_routing=args.routing)
        self.tokenizer = self.inner.tokenizer

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def reply(self, contexts: Any, turn: int) -> Any:
        return self.inner.reply(contexts, turn)

    def close(self) -> None:
        self.llm.close()


def _policy(args: argparse.Namespace, params: Any) -> Any:
    if args.url is None:
        return _LocalPolicy(args, params)
    from openk3.rl.http_policy import HTTPPolicy
    from openk3.serve.loading import model_tokenizer

    return HTTPPolicy(args.url, model_tokenizer(args.model, 0), params, None, args.routing, args.api_key)


def _run_groups(args: argparse.Namespace, task: Any, policy: Any, sandboxes: Any) -> dict[str, Any]:
    from openk3.rl.branching import run_branched
    from openk3.rl.episode import run_group
    from openk3.rl.task_file import trajectory_record

    written, dropped, rewards = 0, [], []
    start = time.perf_counter()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as out:
        group = 0
        while written < args.episodes:
            try:
                if args.branch_at is None:
                    trajectories = run_group(task, policy, sandboxes, args.group, args.max_turns, args.tool_timeout_s)
                else:
                    trajectories = run_branched(task, policy, sandboxes, args.branch_at, args.group, args.max_turns, args.tool_timeout_s).trajectories
            except RuntimeError as e:  # the weights changed under the group, or its sandbox could not be set up
                dropped.append(f"group {group}: {e}")
                if len(dropped) > args.episodes:
                    raise ValueError(f"{len(dropped)} groups dropped, the last: {e}") from e
                group += 1
                continue
            for t in trajectories:
                out.write(json.dumps(trajectory_record(t, group, args.routing)) + "\n")
                rewards.append(t.reward)
            written += len(trajectories)
            group += 1
    elapsed = time.perf_counter() - start
    return {
        "trajectories": written,
        "groups": group,
        "dropped": dropped,
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "rollouts_per_min": 60 * written / elapsed if elapsed > 0 else None,
        "out": str(args.out),
    }

"""Branching mid-episode: one trunk episode runs `branch_at` turns, then its sandbox is snapshotted and forked and its
conversation copied into `n` branches, which go on (a turn at a time, batched) to the turn limit. The sandbox fork gives each
branch the trunk's files; the engine's prefix cache gives each branch's first request the trunk's computed context (the KDA
state and MLA latents cached when the trunk's last request finished), so a branch computes only the trunk's last observation
and its own tokens instead of the episode from its start.

Every branch's trajectory holds the trunk's tokens first (`Trajectory.shared_prefix` says how many), so each is a whole
episode a trainer can score on its own. A trunk that ends before the branch point (a reply with no tool call) is returned
alone, unforked.

Routing replay and the cache: a request that asks for its routing (SamplingParams.return_routing) is refused prefix hits by
the engine (serve/scheduler.py), because a cached prefix carries no record of the experts that computed it: that
request's trace would have to take those positions from an earlier trace, which is exact only if that earlier request is
the one whose states were cached, and the cache does not say which request computed a state. So branches that record
routing recompute the trunk (exact routing, cached tokens 0), and branches that do not reuse it (docs/rollouts.md has the
cost of each, benchmarks/rollouts.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from openk3.rl.episode import Branch, Task, TaskSandboxes, branches_of, finish, take_turn
from openk3.rl.policy import Context, Policy
from openk3.rl.tools import Sandboxes
from openk3.rl.trajectory import Trajectory


@dataclass
class BranchedGroup:
    trajectories: list[Trajectory]
    trunk_turns: int  # turns the trunk took before the fork
    fork_s: float | None = None  # snapshot + fork of the trunk's sandbox; None when the trunk ended before the branch point
    shared_tokens: int = 0  # the trunk's tokens every branch starts from
    first_cached: list[int] = field(default_factory=list)  # each branch's first reply: context tokens taken from the prefix cache


def copy_branch(trunk: Branch, index: int, sandbox_id: str) -> Branch:
    """A branch that continues the trunk's conversation in its own sandbox."""
    return Branch(
        index,
        sandbox_id,
        list(trunk.token_ids),
        list(trunk.loss_mask),
        list(trunk.logprobs),
        list(trunk.turns),
        list(trunk.routing),
        list(trunk.texts),
        list(trunk.cached),
    )


def run_branched(
    task: Task,
    policy: Policy,
    sandboxes: Sandboxes,
    branch_at: int,
    n: int,
    max_turns: int,
    tool_timeout_s: float = 30.0,
    clock: Callable[[], float] = time.perf_counter,
) -> BranchedGroup:
    """Run the trunk `branch_at` turns, fork it into `n` branches and run them to `max_turns` (module docstring)."""
    if n < 1 or not 0 < branch_at < max_turns:
        raise ValueError(f"run_branched: n={n}, branch_at={branch_at}, max_turns={max_turns}: expected n >= 1 and 0 < branch_at < max_turns")
    made = TaskSandboxes()
    try:
        (trunk,) = branches_of(task, policy.tokenizer, made.open(task, sandboxes, 1, tool_timeout_s))
        version = policy.weight_version
        turn = 0
        while turn < branch_at and not trunk.done:
            (reply,) = policy.reply([Context(0, trunk.token_ids)], turn)
            take_turn(trunk, reply, policy, sandboxes, task.documents, tool_timeout_s, last=False)
            turn += 1
        if trunk.done:
            return BranchedGroup([finish(task, trunk, sandboxes, version)], turn)
        start = clock()
        forks = made.fork(sandboxes, trunk.sandbox_id, n)
        fork_s = clock() - start
        branches = [copy_branch(trunk, i, sid) for i, sid in enumerate(forks)]
        shared = len(trunk.token_ids)
        for turn in range(branch_at, max_turns):
            live = [b for b in branches if not b.done]
            if not live:
                break
            replies = policy.reply([Context(b.index, b.token_ids) for b in live], turn)
            for b, reply in zip(live, replies, strict=True):
                take_turn(b, reply, policy, sandboxes, task.documents, tool_timeout_s, last=turn == max_turns - 1)
        if policy.weight_version != version:
            raise RuntimeError("the policy's weights changed during a branched episode")
        out = [finish(task, b, sandboxes, version, shared) for b in branches]
        first = [b.cached[len(trunk.cached)] for b in branches]
        return BranchedGroup(out, branch_at, fork_s, shared, first)
    finally:
        made.remove(sandboxes)

"""Agent episodes run concurrently against one AsyncEngine: every branch of every group is its own asyncio task, so while
one branch waits for its tool (run on a worker thread) the engine goes on decoding the others. The bookkeeping is
rl/episode.py's (the same Branch, take_reply / take_observation, verifier and clean-up); only the scheduling differs:
a branch asks for its next reply as soon as its observation is in, instead of the group taking turns together.

Weight versions: the server may take new weights between two turns of an episode (AsyncEngine.call_idle drains the
requests in flight, not the episodes). A trajectory whose replies were sampled with more than one version is not a
sample of any one policy: it is dropped and counted (`Rollouts.dropped`, with the versions), never repaired.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from openk3.rl.async_policy import AsyncPolicy
from openk3.rl.documents import DocumentStore
from openk3.rl.episode import Branch, Task, TaskSandboxes, branches_of, finish, take_observation, take_reply
from openk3.rl.policy import Context
from openk3.rl.tools import Sandboxes, run_tool
from openk3.rl.trajectory import Trajectory


@dataclass
class Rollouts:
    trajectories: list[Trajectory] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # "task/index: why", one per episode dropped

    def extend(self, other: Rollouts) -> None:
        self.trajectories.extend(other.trajectories)
        self.dropped.extend(other.dropped)


async def _episode(b: Branch, policy: AsyncPolicy, sandboxes: Sandboxes, documents: DocumentStore | None, max_turns: int, timeout_s: float) -> list[int | None]:
    """Run one branch to its end; the weight version of each of its replies."""
    versions: list[int | None] = []
    for turn in range(max_turns):
        reply = await policy.reply(Context(b.index, b.token_ids), turn)
        versions.append(reply.weight_version)
        call = take_reply(b, reply, policy.tokenizer)
        if call is None:
            break
        result = await asyncio.to_thread(run_tool, call, sandboxes, b.sandbox_id, documents, timeout_s)
        take_observation(b, call, result, policy.tokenizer, last=turn == max_turns - 1)
    return versions


async def run_group_async(task: Task, policy: AsyncPolicy, sandboxes: Sandboxes, n: int, max_turns: int, tool_timeout_s: float = 30.0) -> Rollouts:
    """`n` trajectories of `task` from one snapshot of its sandbox, every branch its own task (module docstring)."""
    if n < 1 or max_turns < 1:
        raise ValueError(f"run_group_async: n={n} and max_turns={max_turns}, expected both >= 1")
    made = TaskSandboxes()
    try:
        forks = await asyncio.to_thread(made.open, task, sandboxes, n, tool_timeout_s)
        branches = branches_of(task, policy.tokenizer, forks)
        versions = await asyncio.gather(*(_episode(b, policy, sandboxes, task.documents, max_turns, tool_timeout_s) for b in branches))
        out = Rollouts()
        for b, seen in zip(branches, versions, strict=True):
            if len(set(seen)) > 1:
                out.dropped.append(f"{task.task_id}/{b.index}: replies sampled with weight versions {seen}")
                continue
            version = seen[0] if seen and seen[0] is not None else 0
            out.trajectories.append(await asyncio.to_thread(finish, task, b, sandboxes, version))
        return out
    finally:
        await asyncio.to_thread(made.remove, sandboxes)


async def run_groups_async(tasks: Sequence[Task], policy: AsyncPolicy, sandboxes: Sandboxes, n: int, max_turns: int, tool_timeout_s: float = 30.0) -> Rollouts:
    """Every task's group at once, in task order."""
    groups = await asyncio.gather(*(run_group_async(t, policy, sandboxes, n, max_turns, tool_timeout_s) for t in tasks))
    out = Rollouts()
    for g in groups:
        out.extend(g)
    return out

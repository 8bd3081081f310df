"""Agent episodes in sandboxes, a GRPO group at a time: a task's sandbox is set up once and snapshotted, the snapshot is
forked into one sandbox per sample, and every live branch takes a turn together (one batched generate call), for at most
`max_turns` turns: the policy replies, a tool call in the reply runs in that branch's sandbox, and its observation goes
back as tokens. An episode ends at a reply with no tool call or at the turn limit; the task's verifier then scores the
branch's sandbox. Every sandbox and snapshot made here is removed again, also when something raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from openk3.rl.policy import Context, Policy, Reply
from openk3.rl.tools import Sandboxes, observation_text, parse_call, run_call
from openk3.rl.trajectory import ToolStatus, Trajectory, Turn, stitch_routing
from openk3.serve.routing import RoutingTrace

Verifier = Callable[[Sandboxes, str], float]  # (sandboxes, the branch's sandbox id) -> reward, from what the sandbox holds


@dataclass(frozen=True)
class Task:
    task_id: str
    prompt: str  # the text the episode starts from (encoded once, with the tokenizer's special tokens)
    verify: Verifier
    setup: str | None = None  # a shell command run once in the task's sandbox before it is snapshotted


@dataclass
class _Branch:
    index: int
    sandbox_id: str
    token_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float | None]
    turns: list[Turn] = field(default_factory=list)
    routing: list[tuple[int, RoutingTrace]] = field(default_factory=list)
    done: bool = False

    def add(self, ids: tuple[int, ...], logprobs: tuple[float, ...] | None) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([logprobs is not None] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [None] * len(ids))


def run_group(task: Task, policy: Policy, sandboxes: Sandboxes, n: int, max_turns: int, tool_timeout_s: float = 30.0) -> list[Trajectory]:
    """`n` trajectories of `task` from one snapshot of its sandbox (module docstring)."""
    if n < 1 or max_turns < 1:
        raise ValueError(f"run_group: n={n} and max_turns={max_turns}, expected both >= 1")
    base = sandboxes.create()
    snapshot_id: str | None = None
    forks: list[str] = []
    try:
        if task.setup is not None:
            result = sandboxes.exec(base, task.setup, timeout_s=tool_timeout_s)
            if result.exit_code != 0 or result.timed_out:
                raise RuntimeError(f"task {task.task_id}: setup exited {result.exit_code}: {result.stderr.decode(errors='replace')[-500:]}")
        snapshot_id = sandboxes.snapshot(base).snapshot_id
        forks = sandboxes.fork(snapshot_id, n)
        prompt = policy.tokenizer.encode(task.prompt, add_special_tokens=True)
        branches = [_Branch(i, sid, list(prompt), [False] * len(prompt), [None] * len(prompt)) for i, sid in enumerate(forks)]
        version = policy.weight_version
        for turn in range(max_turns):
            live = [b for b in branches if not b.done]
            if not live:
                break
            replies = policy.reply([Context(b.index, b.token_ids) for b in live], turn)
            for b, reply in zip(live, replies, strict=True):
                _take_turn(b, reply, policy, sandboxes, tool_timeout_s, last=turn == max_turns - 1)
        if policy.weight_version != version:
            raise RuntimeError("the policy's weights changed during a group's episodes")
        return [_finish(task, b, sandboxes, version) for b in branches]
    finally:
        for sid in [*forks, base]:
            sandboxes.destroy(sid)
        if snapshot_id is not None:
            sandboxes.delete_snapshot(snapshot_id)


def _take_turn(b: _Branch, reply: Reply, policy: Policy, sandboxes: Sandboxes, timeout_s: float, last: bool) -> None:
    start = len(b.token_ids)
    b.add(reply.token_ids, reply.logprobs)
    if reply.routing is not None:
        b.routing.append((start, reply.routing))
    text = policy.tokenizer.decode(list(reply.token_ids))
    call = parse_call(text)
    if call is None:
        b.turns.append(Turn(text, None, None))
        b.done = True
        return
    if call.command is None:
        status, code, body = ToolStatus.MALFORMED, None, "error: a tool call must be <bash>command</bash>"
    else:
        status, code, body = run_call(sandboxes, b.sandbox_id, call.command, timeout_s)
    observation = observation_text(body)
    b.turns.append(Turn(text, call.command, status, code, observation))
    if not last:  # the last turn's observation would be read by no one: the trajectory ends at the reply
        b.add(tuple(policy.tokenizer.encode(observation)), None)
    b.done = last


def _finish(task: Task, b: _Branch, sandboxes: Sandboxes, version: int) -> Trajectory:
    routing = stitch_routing(b.routing) if b.routing else None
    reward = task.verify(sandboxes, b.sandbox_id)
    return Trajectory(task.task_id, b.index, tuple(b.token_ids), tuple(b.loss_mask), tuple(b.logprobs), tuple(b.turns), reward, version, routing)

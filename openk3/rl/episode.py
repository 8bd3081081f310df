"""Agent episodes in sandboxes, a GRPO group at a time: a task's sandbox is set up once and snapshotted, the snapshot is
forked into one sandbox per sample, and every live branch takes a turn together (one batched generate call), for at most
`max_turns` turns: the policy replies, a tool call in the reply runs in that branch's sandbox, and its observation goes
back as tokens. An episode ends at a reply with no tool call or at the turn limit; the task's verifier then scores the
branch's sandbox. Every sandbox and snapshot made here is removed again, also when something raises.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from openk3.rl.documents import DocumentStore
from openk3.rl.policy import Context, Policy, Reply
from openk3.rl.tools import Result, Sandboxes, ToolCall, observation_text, parse_call, run_tool
from openk3.rl.trajectory import Trajectory, Turn, stitch_routing
from openk3.serve.routing import RoutingTrace
from openk3.serve.tokenizer import Tokenizer

Verifier = Callable[[Sandboxes, str], float]  # (sandboxes, the branch's sandbox id) -> reward, from what the sandbox holds


@dataclass(frozen=True)
class Task:
    task_id: str
    prompt: str  # the text the episode starts from (encoded once, with the tokenizer's special tokens)
    verify: Verifier
    setup: str | None = None  # a shell command run once in the task's sandbox before it is snapshotted
    documents: DocumentStore | None = None  # the pages the search / open tools read (rl/documents.py), shipped with the task


@dataclass
class Branch:
    index: int
    sandbox_id: str
    token_ids: list[int]
    loss_mask: list[bool]
    logprobs: list[float | None]
    turns: list[Turn] = field(default_factory=list)
    routing: list[tuple[int, RoutingTrace]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # each reply's text
    cached: list[int] = field(default_factory=list)  # each reply's prompt tokens the engine took from its prefix cache
    done: bool = False

    def add(self, ids: tuple[int, ...], logprobs: tuple[float, ...] | None) -> None:
        self.token_ids.extend(ids)
        self.loss_mask.extend([logprobs is not None] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [None] * len(ids))


@dataclass
class TaskSandboxes:
    """What a group made in the sandbox service, so that all of it is removed again (`remove`)."""

    base: str | None = None
    snapshots: list[str] = field(default_factory=list)
    forks: list[str] = field(default_factory=list)

    def open(self, task: Task, sandboxes: Sandboxes, n: int, timeout_s: float) -> list[str]:
        """The task's sandbox, set up and snapshotted, forked into `n` branches (their ids)."""
        self.base = sandboxes.create()
        if task.setup is not None:
            result = sandboxes.exec(self.base, task.setup, timeout_s=timeout_s)
            if result.exit_code != 0 or result.timed_out:
                raise RuntimeError(f"task {task.task_id}: setup exited {result.exit_code}: {result.stderr.decode(errors='replace')[-500:]}")
        return self.fork(sandboxes, self.base, n)

    def fork(self, sandboxes: Sandboxes, source_id: str, n: int) -> list[str]:
        """`n` sandboxes forked from a snapshot of `source_id` as it is now (their ids)."""
        snapshot_id = sandboxes.snapshot(source_id).snapshot_id
        self.snapshots.append(snapshot_id)
        forks = sandboxes.fork(snapshot_id, n)
        self.forks.extend(forks)
        return forks

    def remove(self, sandboxes: Sandboxes) -> None:
        for sid in [*self.forks, *([self.base] if self.base is not None else [])]:
            sandboxes.destroy(sid)
        for snapshot_id in self.snapshots:
            sandboxes.delete_snapshot(snapshot_id)


def branches_of(task: Task, tokenizer: Tokenizer, forks: list[str]) -> list[Branch]:
    prompt = tokenizer.encode(task.prompt, add_special_tokens=True)
    return [Branch(i, sid, list(prompt), [False] * len(prompt), [None] * len(prompt)) for i, sid in enumerate(forks)]


def run_group(task: Task, policy: Policy, sandboxes: Sandboxes, n: int, max_turns: int, tool_timeout_s: float = 30.0) -> list[Trajectory]:
    """`n` trajectories of `task` from one snapshot of its sandbox (module docstring)."""
    if n < 1 or max_turns < 1:
        raise ValueError(f"run_group: n={n} and max_turns={max_turns}, expected both >= 1")
    made = TaskSandboxes()
    try:
        branches = branches_of(task, policy.tokenizer, made.open(task, sandboxes, n, tool_timeout_s))
        version = policy.weight_version
        for turn in range(max_turns):
            live = [b for b in branches if not b.done]
            if not live:
                break
            replies = policy.reply([Context(b.index, b.token_ids) for b in live], turn)
            for b, reply in zip(live, replies, strict=True):
                take_turn(b, reply, policy, sandboxes, task.documents, tool_timeout_s, last=turn == max_turns - 1)
        if policy.weight_version != version:
            raise RuntimeError("the policy's weights changed during a group's episodes")
        return [finish(task, b, sandboxes, version) for b in branches]
    finally:
        made.remove(sandboxes)


def take_turn(b: Branch, reply: Reply, policy: Policy, sandboxes: Sandboxes, documents: DocumentStore | None, timeout_s: float, last: bool) -> None:
    call = take_reply(b, reply, policy.tokenizer)
    if call is not None:
        take_observation(b, call, run_tool(call, sandboxes, b.sandbox_id, documents, timeout_s), policy.tokenizer, last)


def take_reply(b: Branch, reply: Reply, tokenizer: Tokenizer) -> ToolCall | None:
    """Append a reply to the branch; its tool call, or None when it calls none (the branch is done)."""
    start = len(b.token_ids)
    b.add(reply.token_ids, reply.logprobs)
    if reply.routing is not None:
        b.routing.append((start, reply.routing))
    text = tokenizer.decode(list(reply.token_ids))
    b.texts.append(text)
    b.cached.append(reply.cached_tokens)
    call = parse_call(text)
    if call is None:
        b.turns.append(Turn(text, None, None, cached_tokens=reply.cached_tokens))
        b.done = True
    return call


def take_observation(b: Branch, call: ToolCall, result: Result, tokenizer: Tokenizer, last: bool) -> None:
    """Record the call's result (status, exit code, body) and append its observation unless this was the last turn."""
    status, code, body = result
    observation = observation_text(body)
    b.turns.append(Turn(b.texts[-1], call.command, status, code, observation, b.cached[-1], call.tool))
    if not last:  # the last turn's observation would be read by no one: the trajectory ends at the reply
        b.add(tuple(tokenizer.encode(observation)), None)
    b.done = last


def finish(task: Task, b: Branch, sandboxes: Sandboxes, version: int, shared_prefix: int = 0) -> Trajectory:
    routing = stitch_routing(b.routing) if b.routing else None
    reward = task.verify(sandboxes, b.sandbox_id)
    ids, mask, logprobs = tuple(b.token_ids), tuple(b.loss_mask), tuple(b.logprobs)
    return Trajectory(task.task_id, b.index, ids, mask, logprobs, tuple(b.turns), reward, version, routing, shared_prefix)

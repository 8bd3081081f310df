"""Cost per completed agent task (issue 37 item 5): a multi-turn tool-using trajectory on a planned replica.

A task is `turns` model calls. Turn 0 prefills the task prompt; every later turn appends the tool's result
(`turn_input` tokens) to a context that already holds every earlier prompt and output. Of that earlier context a
fraction `prefix_hit` is found in the prefix cache (KV pages and the KDA snapshot at the prefix's end) and the rest is
recomputed. Each turn then decodes `output` tokens, and (except after the last) waits `tool_latency_s` for the tool,
during which the sequence's cache is either
- held in HBM: it keeps a batch slot's share of the replica's cache memory for the wait, charged as
  wait x accelerators / (sequences the replica holds at that context) -- the slot's opportunity cost when memory sets
  the batch;
- offloaded to host DRAM: no HBM held, but the latent pages and the KDA state go out and come back over each rank's host
  link before the next turn (added to the turn's latency, not to the accelerators' busy time: the copy engines do it);
- dropped: nothing held, and the next turn recomputes the whole context (its hit is 0).

GPU-seconds are the replica's busy accelerator-seconds the task takes at full utilisation: prefill tokens at the
marginal cost of a chunk step at that cached length, decode tokens at the replica's decode step for its batch at that
context (its share of the batch), plus the holding charge. $ = GPU-seconds x the price per accelerator-second.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from openk3.checks import check_int, check_number
from openk3.planner.memory import max_concurrency
from openk3.planner.perf import Scenario, evaluate, prefill_step
from openk3.planner.tiers import parked_bytes


class ToolWait(str, enum.Enum):
    HOLD = "hold"
    OFFLOAD = "offload"
    DROP = "drop"


@dataclass(frozen=True)
class AgentTask:
    turns: int
    prompt: int  # turn 0's prompt tokens (system prompt, tools, task)
    turn_input: int  # tokens the tool result adds before each later turn
    output: int  # tokens generated per turn
    tool_latency_s: float
    prefix_hit: float = 1.0  # fraction of the earlier context found in the prefix cache at the next turn
    wait: ToolWait = ToolWait.HOLD

    def __post_init__(self) -> None:
        for name in ("turns", "prompt", "output"):
            check_int("AgentTask", name, getattr(self, name), low=1)
        check_int("AgentTask", "turn_input", self.turn_input, low=0)
        check_number("AgentTask", "tool_latency_s", self.tool_latency_s, low=0)
        check_number("AgentTask", "prefix_hit", self.prefix_hit, low=0, high=1)

    @property
    def final_context(self) -> int:
        return self.prompt + self.turns * self.output + (self.turns - 1) * self.turn_input

    def describe(self) -> str:
        return (
            f"agent task: {self.turns} turns; prompt {self.prompt:,} tokens, +{self.turn_input:,} tool-result tokens per later turn, "
            f"{self.output:,} output tokens per turn (final context {self.final_context:,}); tool latency {self.tool_latency_s:g} s per wait; "
            f"prefix-cache hit {self.prefix_hit:.0%} of the earlier context; cache during tool waits: {self.wait.value}"
        )


@dataclass(frozen=True)
class TurnCost:
    context: int  # tokens cached before the turn's new tokens
    prefill_tokens: float  # new + recomputed
    prefill_gpu_s: float
    decode_gpu_s: float
    hold_gpu_s: float  # HBM held during the tool wait that follows
    wall_s: float  # prefill + decode + reload, without queueing; the tool wait is in TaskCost.wall_s


@dataclass(frozen=True)
class TaskCost:
    task: AgentTask
    turns: tuple[TurnCost, ...]
    usd_per_gpu_s: float

    @property
    def gpu_s(self) -> float:
        return sum(t.prefill_gpu_s + t.decode_gpu_s + t.hold_gpu_s for t in self.turns)

    @property
    def usd(self) -> float:
        return self.gpu_s * self.usd_per_gpu_s

    @property
    def wall_s(self) -> float:
        return sum(t.wall_s for t in self.turns) + (self.task.turns - 1) * self.task.tool_latency_s

    def share(self, part: str) -> float:
        return sum(getattr(t, f"{part}_gpu_s") for t in self.turns) / self.gpu_s


def _prefill(sc: Scenario, tokens: float, cached: int) -> tuple[float, float]:
    """(accelerator-seconds, seconds) to prefill `tokens` new tokens after `cached` ones: chunks of the workload's size,
    one per attention group in a replica step, each query seeing the cache plus the causal half of the new tokens."""
    if tokens <= 0:
        return 0.0, 0.0
    chunk = min(sc.workload.prefill_chunk, max(1, round(tokens)))
    w = replace(sc.workload, prompt=chunk, prefill_chunk=chunk)
    step = prefill_step(sc.with_(workload=w), kv_len=float(cached), mean_keys=cached + (tokens + 1) / 2)
    chunks = tokens / chunk
    n = sc.layout.num_accelerators
    return chunks * step.total_s * n / sc.layout.dp, chunks * step.total_s


def task_cost(sc: Scenario, task: AgentTask) -> TaskCost:
    """The task on `sc`'s replica (layout and batch): per turn, what it costs and how long it takes."""
    n = sc.layout.num_accelerators
    turns = []
    context = 0
    for t in range(task.turns):
        hit = 0.0 if (t > 0 and task.wait == ToolWait.DROP) else task.prefix_hit
        new = task.prompt if t == 0 else task.turn_input
        prefill_tokens = new + (1 - hit) * context
        cached = int(hit * context)
        pre_gpu, pre_s = _prefill(sc, prefill_tokens, cached)
        mid = cached + prefill_tokens + task.output / 2
        m = evaluate(sc.with_(workload=replace(sc.workload, context=max(1, int(mid)))))
        decode_gpu = task.output * n / m.throughput_tok_s
        context = int(cached + prefill_tokens + task.output)
        hold, reload = 0.0, 0.0
        if t < task.turns - 1:
            if task.wait == ToolWait.HOLD:
                slots = max(1, max_concurrency(sc.config, sc.quant, sc.layout, context, sc.system, sc.fill, 2 if sc.spec else 1))
                hold = task.tool_latency_s * n / slots
            elif task.wait == ToolWait.OFFLOAD:
                reload = parked_bytes(sc, context) / (sc.system.host_link_bw * sc.layout.tp)
        turns.append(TurnCost(context, prefill_tokens, pre_gpu, decode_gpu, hold, pre_s + task.output / m.per_user_tok_s + reload))
    return TaskCost(task, tuple(turns), sc.system.price_per_hour / 3600)


def describe_cost(cost: TaskCost, accelerators: int, price_note: str = "") -> list[str]:
    t = cost.task
    return [
        t.describe(),
        f"per completed task on this replica ({accelerators} acc): ${cost.usd:.4f}{price_note}, {cost.gpu_s:,.1f} accelerator-seconds "
        f"(prefill {cost.share('prefill'):.0%}, decode {cost.share('decode'):.0%}, cache held during tool waits {cost.share('hold'):.0%}); "
        f"{sum(x.prefill_tokens for x in cost.turns):,.0f} tokens prefilled, {t.turns * t.output:,} generated; "
        f"wall time {cost.wall_s:,.1f} s ({(t.turns - 1) * t.tool_latency_s:,.1f} s of it tool waits; no queueing)",
    ]

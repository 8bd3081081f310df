"""Trajectory: one agent episode as a trainer consumes it -- every token id in order, which of them the policy sampled
(the loss mask) and their sampling logprobs, the routing the engine used, each turn's tool call and result, the reward.

Token ids are exact: the policy's own ids as sampled and the tool observations' ids as encoded once, concatenated, never
decoded and encoded again. A prompt or tool token has no sampling logprob (None) and a False mask.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from openk3.serve.routing import ROUTING_DTYPE, RoutingTrace


class ToolStatus(str, enum.Enum):
    OK = "ok"  # the command ran (whatever its exit code)
    TIMED_OUT = "timed_out"
    MALFORMED = "malformed"  # the reply opened a tool call it never closed
    REFUSED = "refused"  # the sandbox refused or failed the call (its error is the observation)
    INVALID = "invalid"  # a well-formed call with arguments its tool rejects: an unknown doc id, a page or k out of range


@dataclass(frozen=True)
class Turn:
    """One policy reply and, when it called a tool, the call and what came back."""

    reply: str  # the reply's text (for reading; the ids are the trajectory's)
    command: str | None  # the call's text (shell command, search query, doc id); None for a final answer or a malformed call
    status: ToolStatus | None  # None: no tool was called (the episode's last turn)
    exit_code: int | None = None
    observation: str = ""  # the text fed back to the policy
    cached_tokens: int = 0  # of the reply's context, the tokens the engine took from its prefix cache
    tool: str | None = None  # which tool was called (rl/tools.py TOOLS); None when none was


@dataclass(frozen=True)
class Trajectory:
    task_id: str
    index: int  # which of the group's samples
    token_ids: tuple[int, ...]  # prompt, then each reply and observation, in order
    loss_mask: tuple[bool, ...]  # True exactly for the tokens the policy sampled
    logprobs: tuple[float | None, ...]  # the sampling logprob of each sampled token; None elsewhere
    turns: tuple[Turn, ...]
    reward: float
    weight_version: int  # the engine's weight version every reply was sampled with
    routing: RoutingTrace | None = None  # positions 0 .. end of the last reply - 2 (stitch_routing)
    # tokens 0 .. shared_prefix - 1 are the trunk this branch forked from (rl/branching.py), the same in every sibling:
    # a trainer that counts them once masks them in all branches but one
    shared_prefix: int = 0

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.loss_mask) != n or len(self.logprobs) != n:
            raise ValueError(f"trajectory {self.task_id}/{self.index}: {n} tokens, {len(self.loss_mask)} mask, {len(self.logprobs)} logprobs")
        for i, (m, lp) in enumerate(zip(self.loss_mask, self.logprobs, strict=True)):
            if m != (lp is not None):
                raise ValueError(f"trajectory {self.task_id}/{self.index}: token {i} is {'sampled' if m else 'not sampled'} but its logprob is {lp}")


def stitch_routing(turns: list[tuple[int, RoutingTrace]]) -> RoutingTrace:
    """One trace over a whole episode from each reply's own: (first position of the reply, the trace its generate call
    returned, which covers the whole context up to the reply's last token but one). The last call's trace gives every
    position; the positions each earlier reply sampled take that reply's trace, as routed when they were sampled."""
    _, last = turns[-1]
    experts = last.experts_TLk.clone().to(ROUTING_DTYPE)
    for start, trace in turns[:-1]:
        if trace.layers != last.layers:
            raise ValueError("routing: replies routed by models with different MoE layers")
        experts[start : trace.experts_TLk.shape[0]] = trace.experts_TLk[start:]
    return RoutingTrace(last.layers, experts)

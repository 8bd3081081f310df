"""GRPO (Shao et al. 2024, DeepSeekMath) over openk3 trajectories: group-relative advantages and one clipped
policy-gradient step of a trainer's copy of the policy, with the engine's routing replayed (R3, rl/routing_replay.py).

Legend: B sequences of one length T, V vocabulary.

- Advantage of sample i of a group: (r_i - mean(r)) / (std(r) + eps), std over the group (population form); a group whose
  rewards are all equal has advantage 0 everywhere and contributes no gradient.
- Loss over every sampled token t (loss mask) of every trajectory, averaged over all those tokens (token-level, as DAPO):
  -min(rho_t A, clip(rho_t, 1 - eps_clip, 1 + eps_clip) A) with rho_t = exp(logp_new(t) - logp_old(t)); logp_old is the
  engine's sampling logprob from the trajectory. No KL term to a reference policy (stated choice: the demo is short).
- logp is the model's own distribution at temperature 1 before any token rule, which is what the engine reports as a
  token's sampling logprob (serve/sampler.py, vLLM's raw logprobs), so old and new are the same quantity. Sampling with
  token rules (allowed_token_ids) draws from the masked distribution, log pi = logp - log Z_allowed; within a group that
  shares a prompt, Z is the same for every sample's first token and the advantages sum to 0, so for one-token replies
  the gradient is the masked policy's exactly.
- Trajectories of the same length are run as one [B, T] batch; with routing, every MoE layer is given the engine's experts
  for those tokens (sequences end to end, the order forward_tokens flattens them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from openk3.model import K3ForCausalLM
from openk3.rl.routing_replay import replay_routing, trace_rows
from openk3.rl.trajectory import Trajectory


@dataclass(frozen=True)
class GRPOConfig:
    clip_eps: float = 0.2
    adv_eps: float = 1e-4  # keeps a group of nearly equal rewards from blowing its advantages up
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"GRPOConfig.clip_eps={self.clip_eps}, expected 0 < clip_eps < 1")
        if self.adv_eps <= 0 or self.max_grad_norm <= 0:
            raise ValueError(f"GRPOConfig: adv_eps={self.adv_eps} and max_grad_norm={self.max_grad_norm}, expected both > 0")


@dataclass(frozen=True)
class StepStats:
    loss: float
    tokens: int  # sampled tokens the loss averaged over
    max_logprob_gap: float  # max |logp_new - logp_old| before the step: 0 up to float error when the trainer is the sampler
    clipped: float  # fraction of tokens whose ratio was clipped
    grad_norm: float


def group_advantages(rewards: Sequence[float], eps: float = 1e-4) -> list[float]:
    """GRPO's advantages of one group's rewards (module docstring)."""
    n = len(rewards)
    if n == 0:
        raise ValueError("group_advantages: an empty group")
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + eps) for r in rewards]


def _sampled_logprobs(model: K3ForCausalLM, batch: list[Trajectory]) -> torch.Tensor:
    """[B, T-1] logprob under `model` of each next token of the equal-length trajectories in `batch`."""
    ids_BT = torch.tensor([t.token_ids for t in batch])
    traces = [t.routing for t in batch]
    if all(tr is not None for tr in traces):
        rows = trace_rows([tr for tr in traces if tr is not None])  # positions 0 .. T-2 of each, end to end
        with replay_routing(model, rows):
            logits_BTV = model.forward_tokens(ids_BT[:, :-1]).float()
    elif any(tr is not None for tr in traces):
        raise ValueError("grpo: some trajectories carry routing and some do not")
    else:
        logits_BTV = model.forward_tokens(ids_BT[:, :-1]).float()
    return logits_BTV.log_softmax(-1).gather(2, ids_BT[:, 1:, None])[..., 0]


def grpo_step(
    model: K3ForCausalLM,
    optimizer: torch.optim.Optimizer,
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float],
    config: GRPOConfig | None = None,
) -> StepStats:
    """One optimizer step of the GRPO loss (module docstring) over `trajectories`, advantage i for trajectory i."""
    cfg = config or GRPOConfig()
    if len(trajectories) != len(advantages):
        raise ValueError(f"grpo_step: {len(trajectories)} trajectories, {len(advantages)} advantages")
    by_length: dict[int, list[int]] = {}
    for i, t in enumerate(trajectories):
        by_length.setdefault(len(t.token_ids), []).append(i)
    tokens = sum(sum(t.loss_mask[1:]) for t in trajectories)
    if tokens == 0:
        raise ValueError("grpo_step: no sampled tokens in the trajectories")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    total, gap, clipped = 0.0, 0.0, 0
    for idx in by_length.values():
        batch = [trajectories[i] for i in idx]
        new_BT = _sampled_logprobs(model, batch)
        mask_BT = torch.tensor([t.loss_mask[1:] for t in batch])
        old_BT = torch.tensor([[lp if lp is not None else 0.0 for lp in t.logprobs[1:]] for t in batch])
        adv_B1 = torch.tensor([advantages[i] for i in idx], dtype=torch.float32)[:, None]
        ratio_BT = torch.exp(torch.where(mask_BT, new_BT - old_BT, torch.zeros_like(new_BT)))  # 1 off the mask
        clipped_ratio = ratio_BT.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps)
        objective_BT = torch.minimum(ratio_BT * adv_B1, clipped_ratio * adv_B1)
        loss = -(objective_BT * mask_BT).sum() / tokens
        loss.backward()
        total += float(loss.detach())
        with torch.no_grad():
            gap = max(gap, float(((new_BT - old_BT).abs() * mask_BT).max()))
            clipped += int(((ratio_BT - clipped_ratio).abs() > 0).logical_and(mask_BT).sum())
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
    optimizer.step()
    model.eval()
    return StepStats(total, tokens, gap, clipped / tokens, grad_norm)

"""Distillation losses: the KL between a teacher's and the student's next-token distributions, per row, exact or from the
teacher's top-k.

Legend: N rows (token positions), V the student's vocabulary, k the teacher's stored top-k; p the teacher, q the student.
FORWARD is KL(p || q) = sum_v p (log p - log q) (mass-covering; what classic distillation minimises), REVERSE is
KL(q || p) = sum_v q (log q - log p) (mode-seeking; what on-policy distillation minimises on the student's own samples).

With only the teacher's top-k ids K and their logprobs, two approximations:
- RENORM: both distributions restricted to K and renormalised there, then the exact KL over the k categories;
- TAIL: k + 1 categories, K and one bucket for everything else (p_tail = 1 - sum_K p, q_tail = 1 - sum_K q); by the data
  processing inequality it is a lower bound on the full KL, and its gradient still pushes the student's tail mass to the
  teacher's.
When K covers the whole vocabulary (k >= V) there is no tail and both equal the full KL (tests/train/test_distill_loss.py).
A teacher whose model vocabulary is larger than the student's (padding rows past the shared tokenizer's ids) may name ids
>= V: they are dropped from K, so their probability joins the tail (TAIL) or is renormalised away (RENORM); a row whose
kept ids cover the student's vocabulary is renormalised over them. The teacher's tail is floored at TAIL_FLOOR so that a
reverse KL stays finite when a stored top-k sums to 1 by rounding.
"""

from __future__ import annotations

import enum

import torch
import torch.nn.functional as F

TAIL_FLOOR = 1e-10


class Direction(enum.Enum):
    FORWARD = "forward"  # KL(teacher || student)
    REVERSE = "reverse"  # KL(student || teacher)


class TopK(enum.Enum):
    RENORM = "renorm"
    TAIL = "tail"


def _kl(lp: torch.Tensor, lq: torch.Tensor, valid: torch.Tensor, direction: Direction) -> torch.Tensor:
    """sum over the last axis of the KL terms of the categories where `valid` (logprobs elsewhere may be anything)."""
    lp = torch.where(valid, lp, torch.zeros_like(lp))  # finite placeholders: a masked term must not poison the gradient
    lq = torch.where(valid, lq, torch.zeros_like(lq))
    if direction is Direction.FORWARD:
        terms = lp.exp() * (lp - lq)
    else:
        terms = lq.exp() * (lq - lp)
    return torch.where(valid, terms, torch.zeros_like(terms)).sum(-1)


def full_kl(student_logits_NV: torch.Tensor, teacher_logits_NV: torch.Tensor, direction: Direction) -> torch.Tensor:
    """The exact KL per row [N] from both models' full logits (the reference the top-k forms are tested against)."""
    lq = F.log_softmax(student_logits_NV.float(), -1)
    lp = F.log_softmax(teacher_logits_NV.float(), -1)
    if direction is Direction.FORWARD:
        return (lp.exp() * (lp - lq)).sum(-1)
    return (lq.exp() * (lq - lp)).sum(-1)


def topk_kl(student_logits_NV: torch.Tensor, topk_ids_Nk: torch.Tensor, topk_logprobs_Nk: torch.Tensor, direction: Direction, approx: TopK) -> torch.Tensor:
    """The KL per row [N] against the teacher's top-k (module docstring). The teacher's ids must be distinct per row."""
    lq_NV = F.log_softmax(student_logits_NV.float(), -1)
    V = lq_NV.shape[-1]
    valid = (topk_ids_Nk >= 0) & (topk_ids_Nk < V)
    if not bool(valid.any(-1).all()):
        raise ValueError(f"topk_kl: a row has no teacher id inside the student's vocabulary of {V}")
    ids = torch.where(valid, topk_ids_Nk, torch.zeros_like(topk_ids_Nk)).long()
    neg_inf = torch.full_like(lq_NV[:, :1], float("-inf")).expand_as(ids)
    lq_K = torch.where(valid, lq_NV.gather(-1, ids), neg_inf)
    lp_K = torch.where(valid, topk_logprobs_Nk.float(), neg_inf)
    renorm = _kl(lp_K - lp_K.logsumexp(-1, keepdim=True), lq_K - lq_K.logsumexp(-1, keepdim=True), valid, direction)
    if approx is TopK.RENORM:
        return renorm
    covered = valid.sum(-1) >= V  # distinct ids: k kept ids that cover V leave no tail
    if bool(covered.all()):
        return renorm
    in_K = torch.zeros_like(lq_NV, dtype=torch.bool).scatter_(-1, ids, valid)
    # a covered row's complement is empty: give it zeros so its (unused) tail stays finite, and so does its gradient
    rest = torch.where(in_K, torch.full_like(lq_NV, float("-inf")), lq_NV)
    rest = torch.where(covered[:, None], torch.zeros_like(lq_NV), rest)
    lq_tail = rest.logsumexp(-1, keepdim=True)
    p_tail = (1.0 - lp_K.exp().sum(-1, keepdim=True)).clamp(min=TAIL_FLOOR)
    lp_all = torch.cat([lp_K, p_tail.log()], -1)
    lq_all = torch.cat([lq_K, lq_tail], -1)
    tail = _kl(lp_all, lq_all, torch.cat([valid, torch.ones_like(valid[:, :1])], -1), direction)
    return torch.where(covered, renorm, tail)


def masked_mean(values_N: torch.Tensor, mask_N: torch.Tensor | None) -> torch.Tensor:
    """The mean over the rows a loss mask keeps (all rows without one); 0 with a gradient when it keeps none."""
    if mask_N is None:
        return values_N.mean()
    weights = mask_N.to(values_N.dtype)
    return (values_N * weights).sum() / weights.sum().clamp(min=1.0)


def mixed_loss(kl_N: torch.Tensor, ce_N: torch.Tensor, kl_weight: float, kl_mask_N: torch.Tensor | None = None) -> torch.Tensor:
    """kl_weight * mean KL (over the rows a teacher scored) + (1 - kl_weight) * mean next-token cross-entropy (every row)."""
    if not 0.0 <= kl_weight <= 1.0:
        raise ValueError(f"kl_weight={kl_weight} is invalid: expected 0 <= kl_weight <= 1")
    return kl_weight * masked_mean(kl_N, kl_mask_N) + (1.0 - kl_weight) * ce_N.mean()

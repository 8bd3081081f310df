"""The distillation losses against the definition: with k = V both top-k forms equal the full-vocabulary KL (values and
gradients, both directions), on the logits of a tiny model; with k < V the tail bucket is a lower bound on the full KL and
renormalisation equals the KL of the two distributions restricted to the top-k; ids past the student's vocabulary fall into
the tail; a masked row adds nothing."""

import pytest
import torch
import torch.nn.functional as F

from openk3.config import debug
from openk3.model import K3ForCausalLM
from openk3.train.distill_loss import Direction, TopK, full_kl, masked_mean, mixed_loss, topk_kl


def logits_of(seed: int) -> torch.Tensor:
    m = K3ForCausalLM(debug())
    m.init_weights(seed=seed)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return m.forward_tokens(ids).reshape(-1, 256).float() * 4  # sharper than at init, so the KL is not tiny


def teacher_topk(teacher_NV: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    top = F.log_softmax(teacher_NV, -1).topk(k)
    return top.indices, top.values


@pytest.mark.parametrize("direction", list(Direction))
@pytest.mark.parametrize("approx", list(TopK))
def test_k_equal_to_vocab_is_the_full_kl(direction, approx) -> None:
    teacher = logits_of(1)
    student_a = logits_of(2).requires_grad_(True)
    student_b = student_a.detach().clone().requires_grad_(True)
    ids, lps = teacher_topk(teacher, 256)
    got = topk_kl(student_a, ids, lps, direction, approx)
    want = full_kl(student_b, teacher, direction)
    assert float(want.detach().mean()) > 0.1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    got.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(student_a.grad, student_b.grad, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("direction", list(Direction))
def test_small_k_approximations(direction) -> None:
    teacher, student = logits_of(1), logits_of(2)
    ids, lps = teacher_topk(teacher, 8)
    full = full_kl(student, teacher, direction)
    tail = topk_kl(student, ids, lps, direction, TopK.TAIL)
    assert bool((tail <= full + 1e-5).all())  # a coarser partition never has more divergence
    assert float(tail.mean()) > 0
    # renormalised: the exact KL of both distributions restricted to K and renormalised there
    lp = F.log_softmax(teacher, -1).gather(-1, ids)
    lq = F.log_softmax(student, -1).gather(-1, ids)
    lp, lq = lp - lp.logsumexp(-1, keepdim=True), lq - lq.logsumexp(-1, keepdim=True)
    want = (lp.exp() * (lp - lq)).sum(-1) if direction is Direction.FORWARD else (lq.exp() * (lq - lp)).sum(-1)
    torch.testing.assert_close(topk_kl(student, ids, lps, direction, TopK.RENORM), want, atol=1e-6, rtol=1e-5)
    # the tail bucket by hand
    p_tail = 1 - lps.exp().sum(-1)
    q_K = F.softmax(student, -1).gather(-1, ids)
    q_tail = 1 - q_K.sum(-1)
    if direction is Direction.FORWARD:
        by_hand = (lps.exp() * (lps - q_K.log())).sum(-1) + p_tail * (p_tail.log() - q_tail.log())
    else:
        by_hand = (q_K * (q_K.log() - lps)).sum(-1) + q_tail * (q_tail.log() - p_tail.log())
    torch.testing.assert_close(tail, by_hand, atol=1e-5, rtol=1e-4)


def test_ids_past_the_student_vocabulary_join_the_tail() -> None:
    """A teacher with 8 padding rows more than the student: its top-k may name them; they count as tail mass."""
    student = logits_of(2)
    teacher = torch.cat([logits_of(1), torch.full((student.shape[0], 8), 3.0)], -1)  # padding rows the teacher likes
    ids, lps = teacher_topk(teacher, 16)
    assert bool((ids >= 256).any())
    got = topk_kl(student, ids, lps, Direction.FORWARD, TopK.TAIL)
    keep = ids < 256
    p_K = torch.where(keep, lps.exp(), torch.zeros_like(lps))
    q_K = F.softmax(student, -1).gather(-1, torch.where(keep, ids, torch.zeros_like(ids)))
    p_tail, q_tail = 1 - p_K.sum(-1), 1 - torch.where(keep, q_K, torch.zeros_like(q_K)).sum(-1)
    terms = torch.where(keep, p_K * (torch.where(keep, lps, torch.zeros_like(lps)) - q_K.log()), torch.zeros_like(lps)).sum(-1)
    torch.testing.assert_close(got, terms + p_tail * (p_tail.log() - q_tail.log()), atol=1e-5, rtol=1e-4)
    # with k = the teacher's whole vocabulary the kept ids cover the student's: renormalised over them, no tail
    ids, lps = teacher_topk(teacher, 264)
    got = topk_kl(student, ids, lps, Direction.REVERSE, TopK.TAIL)
    torch.testing.assert_close(got, full_kl(student, teacher[:, :256], Direction.REVERSE), atol=1e-5, rtol=1e-5)


def test_mask_and_mixing() -> None:
    kl = torch.tensor([1.0, 3.0, 100.0])
    ce = torch.tensor([2.0, 2.0, 2.0])
    mask = torch.tensor([True, True, False])
    assert float(masked_mean(kl, mask)) == 2.0
    assert float(mixed_loss(kl, ce, 0.25, mask)) == pytest.approx(0.25 * 2.0 + 0.75 * 2.0)
    assert float(masked_mean(kl, torch.zeros(3, dtype=torch.bool))) == 0.0
    with pytest.raises(ValueError, match="kl_weight"):
        mixed_loss(kl, ce, 1.5)

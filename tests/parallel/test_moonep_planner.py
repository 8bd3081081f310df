"""MoonEP planner: vectorised == reference (plan and per-entry routes), conservation and capacity on random and adversarial
loads, one home per destination, spills only below E/R prefetch slots, and check_plan rejects broken plans. No ranks needed."""

from __future__ import annotations

import pytest
import torch

from openk3.parallel.ep.moonep import MoonPlan, assign_entries, check_plan, plan_moonep
from openk3.parallel.ep.moonep_ref import assign_entries_reference, plan_reference


def random_load(seed: int, ranks: int, epn: int, skew: float, max_tokens: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.arange(1, ranks * epn + 1).float().pow(-skew)[torch.randperm(ranks * epn, generator=g)]
    rows = []
    for _ in range(ranks):
        n = int(torch.randint(0, max_tokens, (1,), generator=g))
        picks = torch.multinomial(p, n, replacement=True, generator=g) if n else torch.zeros(0, dtype=torch.int64)
        rows.append(torch.bincount(picks, minlength=ranks * epn))
    return torch.stack(rows)


def adversarial_loads() -> list[tuple[str, torch.Tensor, int]]:
    ranks, epn = 4, 3
    out = []
    one_expert = torch.zeros(ranks, ranks * epn, dtype=torch.int64)
    one_expert[:, 5] = 50
    out.append(("all tokens to one expert", one_expert, epn))
    one_home = torch.zeros(ranks, ranks * epn, dtype=torch.int64)
    one_home[:, :epn] = torch.tensor([30, 20, 10])
    out.append(("all tokens to one home rank", one_home, epn))
    out.append(("no tokens", torch.zeros(ranks, ranks * epn, dtype=torch.int64), epn))
    one_source = torch.zeros(ranks, ranks * epn, dtype=torch.int64)
    one_source[2] = torch.arange(ranks * epn)
    out.append(("one source rank has every token", one_source, epn))
    out.append(("one rank", torch.tensor([[7, 0, 3]]), 3))
    out.append(("uneven total (remainder)", torch.tensor([[5, 0, 0, 0], [2, 0, 0, 0]]), 2))
    out.append(("sixteen ranks, one expert each", random_load(9, 16, 1, 1.5, 200), 1))
    return out


def cases() -> list:
    rnd = [(f"random seed={s}", random_load(s, 1 + s % 8, 1 + s % 4, 0.5 * (s % 4), 60), 1 + s % 4) for s in range(12)]
    return [pytest.param(tpe, epn, id=name) for name, tpe, epn in rnd + adversarial_loads()]


def assert_same_plan(a: MoonPlan, b: MoonPlan) -> None:
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, name


def entries_of(tpe_RE: torch.Tensor, rank: int, seed: int) -> torch.Tensor:
    flat = torch.repeat_interleave(torch.arange(tpe_RE.shape[1]), tpe_RE[rank])
    return flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("tpe,epn", cases())
@pytest.mark.parametrize("slots_below_epn,pad", [(0, 1), (1, 4)], ids=["B=epn,pad=1", "B=epn-1,pad=4"])
def test_vectorised_equals_reference_and_properties(tpe: torch.Tensor, epn: int, slots_below_epn: int, pad: int) -> None:
    ranks = tpe.shape[0]
    slots = max(0, epn - slots_below_epn)
    plan = plan_moonep(tpe, epn, slots, pad)
    assert_same_plan(plan, plan_reference(tpe, epn, slots, pad))
    check_plan(plan, tpe)
    total = int(tpe.sum())
    assert plan.capacity == -(-total // ranks)
    assert int(plan.load_R().sum()) == total
    home = torch.arange(ranks * epn) // epn
    remote = (plan.alloc_ER > 0) & (home.unsqueeze(1) != torch.arange(ranks))
    # Each destination is filled by one home only, so it never runs more than epn remote experts.
    for d in range(ranks):
        assert home[remote[:, d]].unique().numel() <= 1
    if slots >= epn:
        assert plan.spilled == 0 and int(plan.load_R().max()) <= plan.capacity
        # Perfect balance: only the rounding remainder of ceil(total / R) leaves some ranks short.
        assert int((plan.capacity - plan.load_R()).sum()) == plan.capacity * ranks - total
    seen = torch.zeros(plan.buffer_slots, ranks, dtype=torch.int64)
    for r in range(ranks):
        idx = entries_of(tpe, r, seed=r)
        route = assign_entries(plan, tpe, r, idx)
        ref = assign_entries_reference(plan, tpe, r, idx)
        assert all(torch.equal(x, y) for x, y in zip(route, ref, strict=True))
        assert bool((route.slot_N < plan.offset_ER[idx, route.dest_N] + plan.alloc_ER[idx, route.dest_N]).all())
        assert bool((route.slot_N >= plan.offset_ER[idx, route.dest_N]).all())
        seen.index_put_((route.slot_N, route.dest_N), torch.ones_like(route.slot_N), accumulate=True)
    # Every planned slot on every rank is filled exactly once across all source ranks.
    assert (seen.numel() == 0 or int(seen.max()) <= 1) and int(seen.sum()) == total


def test_no_prefetch_slots_means_no_balancing() -> None:
    tpe = adversarial_loads()[1][1]
    plan = plan_moonep(tpe, 3, 0)
    check_plan(plan, tpe)
    assert plan.prefetch_experts.numel() == 0
    assert torch.equal(plan.alloc_ER.sum(1), tpe.sum(0)) and int(plan.load_R()[0]) == int(tpe.sum())
    assert plan.spilled == int(tpe.sum()) - plan.capacity


def test_check_plan_rejects_broken_plans() -> None:
    tpe = random_load(3, 4, 2, 1.0, 80)
    plan = plan_moonep(tpe, 2, 2)
    lost = plan.alloc_ER.clone()
    lost[0, 0] += 1
    with pytest.raises(RuntimeError, match="not conserved"):
        check_plan(MoonPlan(**{**plan.__dict__, "alloc_ER": lost}), tpe)
    heavy = plan.alloc_ER.clone()
    e = int(plan.alloc_ER.sum(1).argmax())
    heavy[e] = 0
    heavy[e, 0] = plan.alloc_ER[e].sum()
    with pytest.raises(RuntimeError):
        check_plan(MoonPlan(**{**plan.__dict__, "alloc_ER": heavy}), tpe)


def test_k3_shape_is_balanced_and_fast_enough() -> None:
    tpe = random_load(0, 64, 14, 1.5, 4096)
    plan = plan_moonep(tpe, 14, 14)
    check_plan(plan, tpe)
    load = plan.load_R().double()
    assert float(load.max() / load.mean()) <= 1.001
    assert plan.prefetch_experts.numel() <= 64 * 14


def test_bad_shapes_name_the_problem() -> None:
    with pytest.raises(ValueError, match=r"expected \[R, R \* 3\]"):
        plan_moonep(torch.zeros(2, 5, dtype=torch.int64), 3, 3)
    with pytest.raises(ValueError, match="pad=0"):
        plan_moonep(torch.zeros(2, 4, dtype=torch.int64), 2, 2, pad=0)


def test_partial_spill_keeps_the_larger_segment() -> None:
    # Home 0 holds 12 entries over three experts, CAP = 6: rank 1 takes expert 0 (4) and 2 of expert 1; with one prefetch slot
    # the smaller segment (expert 1, 2 entries) goes back home.
    tpe = torch.tensor([[4, 4, 4, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    full = plan_moonep(tpe, 3, 3)
    assert full.load_R().tolist() == [6, 6] and full.prefetch_of(1).tolist() == [0, 1]
    plan = plan_moonep(tpe, 3, 1)
    assert_same_plan(plan, plan_reference(tpe, 3, 1))
    check_plan(plan, tpe)
    assert plan.spilled == 2 and plan.load_R().tolist() == [8, 4] and plan.prefetch_of(1).tolist() == [0]
    assert plan.buffer_slots == 8

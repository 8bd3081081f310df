"""Issue 37 item 3: layouts that cannot exist. TP groups sit whole inside one scale-up domain (no TP3 on 8-GPU nodes),
and the engines and runtime notes of a plan follow the accelerator's vendor (no TensorRT-LLM or CUDA/NCCL on AMD)."""

from __future__ import annotations

import pytest

from openk3.config import k3
from openk3.planner.cli import main
from openk3.planner.hardware import Vendor, load_catalogue
from openk3.planner.inputs import Layout, Quantisation
from openk3.planner.memory import candidate_tps
from openk3.planner.placement import tp_placement_problem
from openk3.planner.plan import PlanRequest, make_plan
from openk3.planner.report import render_text
from openk3.planner.runtime import support
from openk3.planner.search import SearchSpace, candidate_layouts

CAT = load_catalogue()
H200, GB300, MI355X = CAT.system("hgx-h200"), CAT.system("gb300-nvl72"), CAT.system("mi355x-8")


def test_tp_groups_that_straddle_nodes_are_named() -> None:
    problem = tp_placement_problem(3, 24, H200)
    assert problem is not None and "ranks 6-8" in problem and "domains 0 and 1" in problem
    assert tp_placement_problem(3, 6, H200) is None  # the whole instance inside one node
    assert tp_placement_problem(3, 72, GB300) is None  # 72 = 24 whole groups of 3 in one NVLink domain
    assert tp_placement_problem(16, 16, H200) is not None  # wider than a node: every group crosses the NIC
    assert tp_placement_problem(4, 24, H200) is None


def test_the_search_never_offers_a_group_across_domains() -> None:
    assert candidate_tps(24, H200, max_tp=8, config=k3()) == [1, 2, 4, 8]
    assert 3 in candidate_tps(72, GB300, max_tp=8, config=k3()) and 6 in candidate_tps(72, GB300, max_tp=8, config=k3())
    space = SearchSpace(sizes=(6, 16, 24, 48, 64), tps=(1, 2, 3, 4, 6, 8))  # even when TP3/TP6 are asked for
    for layout in candidate_layouts(k3(), H200, space):
        assert tp_placement_problem(layout.tp, layout.num_accelerators, H200) is None, layout.describe()
        assert layout.num_accelerators <= 8 or 8 % layout.tp == 0


def test_a_pinned_tp_across_domains_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="ranks 6-8"):
        PlanRequest(config=k3(), system=H200, context=8192, accelerators=24, tp=3)
    with pytest.raises(ValueError, match="TP16 group spans 2 scale-up domains"):
        PlanRequest(config=k3(), system=H200, context=8192, tp=16)
    rc = main(["plan", "--hardware", "hgx-h200", "--context", "8k", "--accelerators", "24", "--tp", "3"])
    assert rc == 2 and "use a TP that divides 8 (1, 2, 4, 8)" in capsys.readouterr().err


def test_engines_and_runtime_notes_follow_the_vendor() -> None:
    assert MI355X.accelerator.vendor == Vendor.AMD and H200.accelerator.vendor == Vendor.NVIDIA
    amd = support(Layout(16, tp=2), 0.7, Quantisation(), Vendor.AMD)
    assert "TensorRT-LLM" not in amd.engines and amd.engines
    assert any("ROCm/RCCL" in m for m in amd.openk3_missing) and not any("CUDA" in m or "NCCL" in m.replace("RCCL", "") for m in amd.openk3_missing)
    nv = support(Layout(16, tp=2), 0.7, Quantisation(), Vendor.NVIDIA)
    assert "TensorRT-LLM" in nv.engines and any("CUDA/NCCL" in m for m in nv.openk3_missing)
    assert support(Layout(16, tp=2), 0.7, Quantisation(), None).engines == ()  # a user row that names no vendor


def test_an_amd_plan_names_no_nvidia_software() -> None:
    plan = make_plan(PlanRequest(config=k3(), system=MI355X, context=8192, accelerators=16, tp=2, concurrency=256))
    text = render_text(plan)
    assert plan.choice is not None and "who can run it" in text
    for word in ("TensorRT-LLM", "CUDA", "NVLink"):
        assert word not in text, word
    assert "ROCm/RCCL" in text and "Infinity Fabric" in text


H200_FIGURES = {k: {"value": v, "source": "me"} for k, v in {"hbm_gb": 141, "hbm_bw_tbps": 4.8, "bf16_tflops": 989, "scale_up_gbps": 450, "tdp_w": 700}.items()}


def test_a_bad_vendor_names_the_row() -> None:
    with pytest.raises(ValueError, match="'my-gpu': vendor='intel' is invalid"):
        CAT.extended({"accelerators": {"my-gpu": {"vendor": {"value": "intel", "source": "me"}, **H200_FIGURES}}})

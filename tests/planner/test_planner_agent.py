"""Cost per completed agent task (issue 37 item 5)."""

from __future__ import annotations

import argparse
import json

import pytest

from openk3.config import k3
from openk3.planner.agent import AgentTask, ToolWait, task_cost
from openk3.planner.cli import build_request, register
from openk3.planner.hardware import load_catalogue
from openk3.planner.inputs import Layout, Quantisation, Workload
from openk3.planner.perf import Scenario, evaluate
from openk3.planner.plan import make_plan
from openk3.planner.report_json import render_json

SC = Scenario(
    k3(), Quantisation.named("mxfp4"), Layout(72, tp=1), Workload(context=32768, concurrency=72 * 32, prompt=8192), load_catalogue().system("gb300-nvl72")
)


def _task(**over: object) -> AgentTask:
    base = dict(turns=6, prompt=8000, turn_input=1500, output=600, tool_latency_s=3.0)
    return AgentTask(**(base | over))  # type: ignore[arg-type]


def test_one_turn_is_a_request() -> None:
    cost = task_cost(SC, _task(turns=1))
    (turn,) = cost.turns
    assert turn.prefill_tokens == 8000 and turn.hold_gpu_s == 0 and cost.wall_s == turn.wall_s
    m = evaluate(SC.with_(workload=Workload(context=8000 + 300, concurrency=72 * 32, prompt=8192)))
    assert turn.decode_gpu_s == pytest.approx(600 * 72 / m.throughput_tok_s)
    assert cost.usd == pytest.approx(cost.gpu_s * 7.5 / 3600)


def test_context_grows_and_hits_save_prefill() -> None:
    t = _task()
    full = task_cost(SC, t)
    assert full.turns[-1].context == t.final_context
    assert sum(x.prefill_tokens for x in full.turns) == 8000 + 5 * 1500  # every earlier token found in the cache
    half = task_cost(SC, _task(prefix_hit=0.5))
    assert sum(x.prefill_tokens for x in half.turns) > sum(x.prefill_tokens for x in full.turns)
    assert half.gpu_s > full.gpu_s


def test_tool_wait_policies() -> None:
    hold, offload, drop = (task_cost(SC, _task(wait=w)) for w in ToolWait)
    assert hold.share("hold") > 0 and offload.share("hold") == 0 and drop.share("hold") == 0
    assert offload.wall_s > hold.wall_s  # the reload before each later turn
    # dropping the cache recomputes every earlier token at every turn
    contexts = [x.context for x in hold.turns]
    assert sum(x.prefill_tokens for x in drop.turns) == pytest.approx(8000 + sum(1500 + c for c in contexts[:-1]))
    assert drop.gpu_s > hold.gpu_s > offload.gpu_s
    # a longer tool wait costs more only while the cache is held
    assert task_cost(SC, _task(tool_latency_s=30.0)).gpu_s > hold.gpu_s
    assert task_cost(SC, _task(tool_latency_s=30.0, wait=ToolWait.OFFLOAD)).gpu_s == pytest.approx(offload.gpu_s)


def test_cli_agent_flags_and_json() -> None:
    p = argparse.ArgumentParser()
    register(p.add_subparsers())
    base = ["plan", "--model", "k3", "--hardware", "gb300-nvl72", "--accelerators", "72", "--input", "8k", "--output", "600"]
    with pytest.raises(ValueError, match="--tool-latency"):
        build_request(p.parse_args([*base, "--agent-turns", "4"]))
    req = build_request(p.parse_args([*base, "--agent-turns", "4", "--tool-latency", "2", "--tool-wait", "offload"]))
    assert req.agent is not None and req.agent.wait == ToolWait.OFFLOAD and req.agent.prompt == 8192
    doc = json.loads(json.dumps(render_json(make_plan(req)), allow_nan=False))
    assert doc["agent_task"]["per_turn"][0]["prefill_tokens"] == 8192 and doc["agent_task"]["turns"] == 4 and doc["agent_task"]["usd"] > 0

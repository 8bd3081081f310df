"""Capacity planner for K3-class models: how many accelerators, what latency, what cost per token, and why.

Pure arithmetic on `openk3.config.ModelConfig` and the engine's cache byte specs; no torch, no device. Typical use:

    from openk3.planner import PlanRequest, load_catalogue, make_plan, render_text, k3
    plan = make_plan(PlanRequest(config=k3(), system=load_catalogue().system("gb300-nvl72"), context=32768))
    print(render_text(plan))

Lower-level pieces: `working_set` / `max_concurrency` / `min_accelerators` (memory), `evaluate(Scenario)` (step time and
cost), `search` (layouts x batch sizes under SLOs), `tier_table` (offload), `calibrate` (fit efficiencies), `why_not`
(what does not fit, by how much), `support` (who can run a layout: openk3 today, and which engines), `resolve_model` /
`load_hf_model` (presets or HF config.json files), `with_dtypes` (mixed quantisation), `RequestMix` / `demand` (workloads),
`pareto_rows` (the SLO-constrained front), `step_traffic` (decode-step bytes by flow), `compare` (xPyD disaggregation
vs aggregated), `long_prefill` / `KDASplit` (PP and CP for long prompts), `Efficiency.measured` / `curves_for`
(measured per-operator curves), `SpecDecoding` (speculative decoding), `AgentTask` / `task_cost` (cost per agent task),
`simulate` / `replica_queue` (queueing percentiles).
"""

from openk3.config import k3
from openk3.planner.agent import AgentTask, TaskCost, ToolWait, task_cost
from openk3.planner.attention import GQAConfig, GQAModelConfig, attention_shape
from openk3.planner.balance import BalanceParams, rank_imbalance
from openk3.planner.calibrate import Fit, Measurement, calibrate
from openk3.planner.comm import CommParams, a2a_layer_time, bytes_per_token_per_layer, expected_destination_ranks
from openk3.planner.disagg import Comparison, compare
from openk3.planner.dtypes import with_dtypes
from openk3.planner.energy import PowerParams
from openk3.planner.hardware import Accelerator, Catalogue, System, load_catalogue
from openk3.planner.hf_load import HFModel, load_hf_model
from openk3.planner.inputs import Balance, Layout, Quantisation, Workload, parse_tokens
from openk3.planner.memory import MemoryBreakdown, max_concurrency, min_accelerators, weight_bytes, working_set
from openk3.planner.models import ModelSource, deepseek_v3, k3_all_mla, kimi_k2, model_by_name, qwen3_235b, resolve_model
from openk3.planner.op_efficiency import OpCurves, curves_for
from openk3.planner.overheads import Overheads
from openk3.planner.pareto import FrontRow, pareto_rows
from openk3.planner.perf import Efficiency, Metrics, Scenario, decode_step, evaluate, prefill_batch_step, prefill_step
from openk3.planner.plan import Plan, PlanRequest, make_plan
from openk3.planner.pp_cp import KDASplit, LongPrefill, long_prefill
from openk3.planner.queueing import Arrivals, QueueOptions, QueueSpec, QueueStats, replica_queue, simulate
from openk3.planner.report import render_json, render_text, write_plot
from openk3.planner.runtime import Support, support
from openk3.planner.search import SLO, Candidate, Misfit, SearchSpace, search, why_not
from openk3.planner.speculative import SpecDecoding
from openk3.planner.tiers import break_even_tokens, tier_table
from openk3.planner.traffic import Traffic, step_traffic
from openk3.planner.workload import Demand, RequestMix, demand

__all__ = [
    "AgentTask",
    "Arrivals",
    "OpCurves",
    "Overheads",
    "QueueOptions",
    "QueueSpec",
    "QueueStats",
    "SpecDecoding",
    "TaskCost",
    "ToolWait",
    "curves_for",
    "qwen3_235b",
    "replica_queue",
    "simulate",
    "task_cost",
    "Comparison",
    "FrontRow",
    "KDASplit",
    "LongPrefill",
    "Traffic",
    "compare",
    "long_prefill",
    "pareto_rows",
    "step_traffic",
    "SLO",
    "Accelerator",
    "Balance",
    "Candidate",
    "BalanceParams",
    "Catalogue",
    "Demand",
    "GQAConfig",
    "GQAModelConfig",
    "HFModel",
    "ModelSource",
    "RequestMix",
    "attention_shape",
    "demand",
    "load_hf_model",
    "resolve_model",
    "with_dtypes",
    "CommParams",
    "Efficiency",
    "Fit",
    "Layout",
    "Measurement",
    "MemoryBreakdown",
    "Metrics",
    "Misfit",
    "Plan",
    "PlanRequest",
    "PowerParams",
    "Quantisation",
    "Scenario",
    "SearchSpace",
    "Support",
    "System",
    "Workload",
    "a2a_layer_time",
    "break_even_tokens",
    "bytes_per_token_per_layer",
    "calibrate",
    "decode_step",
    "deepseek_v3",
    "evaluate",
    "expected_destination_ranks",
    "k3",
    "k3_all_mla",
    "kimi_k2",
    "load_catalogue",
    "make_plan",
    "max_concurrency",
    "min_accelerators",
    "model_by_name",
    "parse_tokens",
    "prefill_batch_step",
    "prefill_step",
    "rank_imbalance",
    "render_json",
    "render_text",
    "search",
    "support",
    "tier_table",
    "weight_bytes",
    "why_not",
    "working_set",
    "write_plot",
]

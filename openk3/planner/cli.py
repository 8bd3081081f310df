"""`openk3 plan`: the capacity planner on the command line. `register(subparsers)` adds the sub-command."""

from __future__ import annotations

import argparse
import json
import sys

from openk3.planner.agent import AgentTask, ToolWait
from openk3.planner.dtypes import CACHE_BYTES, STATE_BYTES, WEIGHT_FORMATS, with_dtypes
from openk3.planner.efficiency import KERNEL_MODES
from openk3.planner.hardware import load_catalogue
from openk3.planner.inputs import Balance, Quantisation, parse_tokens
from openk3.planner.models import MODELS, resolve_model
from openk3.planner.perf import Efficiency
from openk3.planner.plan import PlanRequest, make_plan
from openk3.planner.pp_cp import KDASplit
from openk3.planner.queueing import Arrivals, QueueOptions
from openk3.planner.report import PlotUnavailable, render_json, render_text, write_plot
from openk3.planner.search import SLO, SearchSpace
from openk3.planner.speculative import SpecDecoding
from openk3.planner.workload import RequestMix


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="capacity planner: accelerators, latency, cost per token, and what binds",
        description="Plan a deployment of a K3-class model: memory per accelerator, decode/prefill step time, "
        "throughput, TTFT, tokens per joule, $ per 1M tokens, and the cheapest layout meeting SLOs.",
    )
    p.add_argument(
        "--model",
        default="k3",
        help=f"model preset ({', '.join(sorted(MODELS))}) or an HF config.json / its folder "
        "(kimi_k3, kimi_linear, deepseek_v3, kimi_k2, qwen3_moe; default k3)",
    )
    p.add_argument("--hardware", default="gb300-nvl72", help="system name from the catalogue (default gb300-nvl72)")
    p.add_argument("--catalogue", default=None, help="extra JSON/YAML catalogue file adding or overriding systems")
    p.add_argument("--context", default=None, help="tokens cached per sequence, e.g. 32k, 128k, 1m (default 32k; derived with --input/--requests)")
    p.add_argument("--prompt", default=None, help="prompt length for TTFT (default: the context)")
    p.add_argument("--input", default=None, help="workload: input tokens per request (with --output)")
    p.add_argument("--output", default=None, help="workload: output tokens per request (with --input)")
    p.add_argument("--requests", default=None, metavar="JSON", help="workload: a JSON list of [input, output] pairs, one per request")
    p.add_argument("--rate", type=float, default=None, help="workload: requests per second -> replicas and accelerators")
    p.add_argument("--concurrency", type=int, default=None, help="sequences decoding at once (default: the cheapest batch meeting the SLO)")
    p.add_argument(
        "--quant", default=None, help="mxfp4 (K3 release), mxfp4-fp8, mxfp4-w4a4, fp8, bf16 (default: mxfp4 for presets, the checkpoint's for a config.json)"
    )
    p.add_argument("--expert-dtype", default=None, choices=sorted(WEIGHT_FORMATS), help="routed-expert weight format (overrides --quant)")
    p.add_argument("--trunk-dtype", default=None, choices=sorted(WEIGHT_FORMATS), help="format of everything else (overrides --quant)")
    p.add_argument("--kv-dtype", default=None, choices=sorted(CACHE_BYTES), help="KV cache / MLA latent format (default bf16)")
    p.add_argument("--state-dtype", default=None, choices=sorted(STATE_BYTES), help="KDA recurrent state format (default fp32)")
    p.add_argument("--accelerators", type=int, default=None, help="instance size (default: the cheapest size the search finds)")
    p.add_argument("--tp", type=int, default=None, help="trunk tensor parallelism, a divisor of the attention heads (default: searched; 1 = DP attention)")
    p.add_argument("--balance", default=None, choices=[b.value for b in Balance], help="expert balancing (default: searched, eplb or moonep)")
    p.add_argument("--redundant-experts", type=int, default=None, help="extra expert replicas in the instance (default: searched, 0 or one per rank)")
    p.add_argument("--price", type=float, default=None, help="USD per accelerator-hour (default: the catalogue's)")
    p.add_argument("--min-user-tok-s", type=float, default=0.0, help="SLO: decode tokens/s per user (default 0)")
    p.add_argument("--max-ttft", type=float, default=float("inf"), help="SLO: time to first token in seconds (default none)")
    p.add_argument("--max-accelerators", type=int, default=288, help="largest instance the search considers (default 288)")
    p.add_argument("--eff-hbm", type=float, default=None, help="HBM bandwidth efficiency (default 0.8)")
    p.add_argument("--eff-gemm", type=float, default=None, help="GEMM efficiency where no measured curve applies (all with --kernels flat; default 0.5)")
    p.add_argument("--eff-attention", type=float, default=None, help="attention kernel efficiency where no measured curve applies (default 0.3)")
    p.add_argument("--comm-overlap", type=float, default=None, help="fraction of communication hidden (default 0.7)")
    p.add_argument("--ideal", action="store_true", help="pure roofline: every efficiency 1, communication hidden")
    p.add_argument(
        "--kernels",
        default=None,
        choices=list(KERNEL_MODES),
        help="measured per-operator curves + CUDA-graph padding + host gap (default; curves for NVIDIA Hopper/Blackwell) "
        "or flat: the first-order model's flat factors, no scheduler overheads",
    )
    p.add_argument("--spec-tokens", type=int, default=None, help="speculative decoding: draft tokens per step (MTP / a draft model); default none")
    p.add_argument(
        "--spec-acceptance",
        default=None,
        help="with --spec-tokens k: a per-draft acceptance rate (0.8) or k+1 probabilities of 0..k accepted drafts (0.1,0.2,0.3,0.4)",
    )
    p.add_argument("--spec-draft-layers", type=float, default=None, help="with --spec-tokens: cost of one draft token in target layers (MTP: 1, the default)")
    p.add_argument(
        "--agent-turns", type=int, default=None, help="cost per completed agent task of this many turns (--input: first prompt, --output: tokens per turn)"
    )
    p.add_argument("--tool-latency", type=float, default=None, help="with --agent-turns: seconds each tool call takes")
    p.add_argument("--turn-input", default=None, help="with --agent-turns: tool-result tokens added before each later turn (default 1k)")
    p.add_argument(
        "--prefix-hit", type=float, default=None, help="with --agent-turns: fraction of the earlier context the prefix cache still holds (default 1)"
    )
    p.add_argument("--tool-wait", default=None, choices=[w.value for w in ToolWait], help="with --agent-turns: the cache during tool waits (default hold)")
    p.add_argument(
        "--arrivals", default=None, choices=[a.value for a in Arrivals], help="with --rate: arrival process of the queueing simulation (default poisson)"
    )
    p.add_argument("--burstiness", type=float, default=None, help="with --arrivals bursty: squared coefficient of variation of the gaps (default 4)")
    p.add_argument("--sim-requests", type=int, default=None, help="with --rate: requests the queueing simulation runs (default 2000)")
    p.add_argument("--seed", type=int, default=None, help="with --rate: seed of the queueing simulation (default 0)")
    p.add_argument("--max-pp", type=int, default=1, help="pipeline stages the search may use for a prompt missing the TTFT SLO (default 1: none)")
    p.add_argument("--max-cp", type=int, default=1, help="context-parallel ranks per prompt the search may use, likewise (default 1: none)")
    p.add_argument(
        "--kda-cp", default="sequential", choices=[k.value for k in KDASplit], help="KDA across CP ranks: state handed rank to rank, or a chunk-parallel scan"
    )
    p.add_argument("--disagg", action="store_true", help="with a workload: best prefill/decode-disaggregated (xPyD) plan beside the aggregated one")
    p.add_argument("--fill", type=float, default=0.9, help="fraction of usable HBM the plan may fill (default 0.9)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plot", default=None, metavar="FILE", help="write charts (PNG/SVG by suffix): memory, Pareto front, bytes by flow; matplotlib extra")
    p.set_defaults(func=run)
    return p


def _efficiency(args: argparse.Namespace) -> Efficiency:
    if args.ideal and args.kernels == "measured":
        raise ValueError("--ideal and --kernels measured contradict each other: the roofline has no measured curves")
    base = Efficiency.ideal() if args.ideal else Efficiency(kernels=args.kernels or "measured")
    changes = {
        k: v
        for k, v in (("hbm", args.eff_hbm), ("gemm", args.eff_gemm), ("attention", args.eff_attention), ("comm_overlap", args.comm_overlap))
        if v is not None
    }
    return Efficiency(**{**base.__dict__, **changes})


def _requests(args: argparse.Namespace) -> RequestMix | None:
    if args.requests is not None:
        if args.input is not None or args.output is not None:
            raise ValueError("--requests replaces --input/--output: give one or the other")
        return RequestMix.from_file(args.requests, args.rate)
    if (args.input is None) != (args.output is None):
        raise ValueError("--input and --output go together (tokens per request)")
    if args.input is not None:
        return RequestMix(((parse_tokens(args.input), parse_tokens(args.output)),), args.rate)
    if args.rate is not None:
        raise ValueError("--rate needs a workload: --input and --output, or --requests")
    return None


def _spec(args: argparse.Namespace) -> SpecDecoding | None:
    if args.spec_tokens is None:
        _unused({"--spec-acceptance": args.spec_acceptance, "--spec-draft-layers": args.spec_draft_layers}, "--spec-tokens (the draft tokens per step)")
        return None
    if args.spec_acceptance is None:
        raise ValueError("--spec-tokens needs --spec-acceptance: a per-draft acceptance rate or the acceptance-length distribution")
    return SpecDecoding.parse(args.spec_tokens, args.spec_acceptance, 1.0 if args.spec_draft_layers is None else args.spec_draft_layers)


def _unused(flags: dict[str, object], needs: str) -> None:
    """Flags that only mean something beside another one are an error without it, never silently dropped."""
    given = [name for name, value in flags.items() if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} {needs}")


def _agent(args: argparse.Namespace, mix: RequestMix | None) -> AgentTask | None:
    if args.agent_turns is None:
        _unused(
            {"--tool-latency": args.tool_latency, "--turn-input": args.turn_input, "--prefix-hit": args.prefix_hit, "--tool-wait": args.tool_wait},
            "--agent-turns",
        )
        return None
    if args.tool_latency is None:
        raise ValueError("--agent-turns needs --tool-latency (seconds per tool call)")
    if mix is None or args.input is None:
        raise ValueError("--agent-turns needs --input (the task's first prompt) and --output (tokens per turn)")
    inp, out = mix.pairs[0]
    turn_input = parse_tokens(args.turn_input or "1k")
    hit = 1.0 if args.prefix_hit is None else args.prefix_hit
    return AgentTask(args.agent_turns, inp, turn_input, out, args.tool_latency, hit, ToolWait(args.tool_wait or "hold"))


def _queue(args: argparse.Namespace, mix: RequestMix | None) -> QueueOptions:
    flags = {"--arrivals": args.arrivals, "--burstiness": args.burstiness, "--sim-requests": args.sim_requests, "--seed": args.seed}
    if mix is None or mix.rate is None:
        _unused(flags, "--rate (the queueing simulation runs at the planned rate)")
        return QueueOptions()
    arrivals = Arrivals(args.arrivals or "poisson")
    if args.burstiness is not None and arrivals != Arrivals.BURSTY:
        raise ValueError("--burstiness needs --arrivals bursty")
    return QueueOptions(arrivals, 4.0 if args.burstiness is None else args.burstiness, 2000 if args.sim_requests is None else args.sim_requests, args.seed or 0)


def build_request(args: argparse.Namespace) -> PlanRequest:
    system = load_catalogue(args.catalogue).system(args.hardware)
    if args.price is not None:
        system = system.with_price(args.price)
    source = resolve_model(args.model)
    mix = _requests(args)
    if mix is not None and (args.context is not None or args.prompt is not None):
        raise ValueError("with a workload (--input/--output or --requests) the context and prompt are derived: drop --context/--prompt")
    context = mix.decode_context if mix else parse_tokens(args.context or "32k")
    prompt = mix.ttft_prompt if mix else (parse_tokens(args.prompt) if args.prompt else None)
    longest = max(i + o for i, o in mix.pairs) if mix else max(context, prompt or 0)
    if longest > source.config.max_position_embeddings:
        raise ValueError(f"{longest:,} tokens exceed the model's max_position_embeddings={source.config.max_position_embeddings:,}")
    quant = with_dtypes(Quantisation.named(args.quant or source.default_quant), args.expert_dtype, args.trunk_dtype, args.kv_dtype, args.state_dtype)
    return PlanRequest(
        config=source.config,
        system=system,
        context=context,
        concurrency=args.concurrency,
        prompt=prompt,
        quant=quant,
        requests=mix,
        accelerators=args.accelerators,
        tp=args.tp,
        balance=Balance(args.balance) if args.balance else None,
        redundant_experts=args.redundant_experts,
        slo=SLO(min_user_tok_s=args.min_user_tok_s, max_ttft_s=args.max_ttft),
        efficiency=_efficiency(args),
        spec=_spec(args),
        agent=_agent(args, mix),
        queue=_queue(args, mix),
        fill=args.fill,
        disaggregate=args.disagg,
        space=SearchSpace(max_accelerators=args.max_accelerators, max_pp=args.max_pp, max_cp=args.max_cp, kda_cp=KDASplit(args.kda_cp)),
    )


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 with a plan (with --disagg a disaggregated one counts when no aggregated layout meets the SLO),
    1 when no layout fits or meets the SLO (the reason is printed), 2 on a bad input."""
    try:
        plan = make_plan(build_request(args))
    except (ValueError, OSError) as exc:
        print(f"openk3 plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(render_json(plan), indent=2, allow_nan=False))
    else:
        print(render_text(plan))
    disaggregated = plan.disagg is not None and plan.disagg.disaggregated is not None
    if plan.problem is not None and not disaggregated:
        print(f"openk3 plan: no plan: {plan.problem}", file=sys.stderr)
        return 1
    if plan.problem is not None:
        print(f"openk3 plan: no aggregated plan ({plan.problem}); the disaggregated plan above meets the SLO", file=sys.stderr)
    if args.plot:
        try:
            path = write_plot(plan, args.plot)
        except PlotUnavailable as exc:
            print(f"openk3 plan: {exc}", file=sys.stderr)
            return 2
        print(f"wrote {path}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m openk3.planner.cli`) until the top-level CLI wires `register` in."""
    parser = argparse.ArgumentParser(prog="openk3")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())

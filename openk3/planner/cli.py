"""`openk3 plan`: the capacity planner on the command line. `register(subparsers)` adds the sub-command."""

from __future__ import annotations

import argparse
import json
import sys

from openk3.planner.hardware import load_catalogue
from openk3.planner.inputs import Balance, Quantisation, parse_tokens
from openk3.planner.models import MODELS, model_by_name
from openk3.planner.perf import Efficiency
from openk3.planner.plan import PlanRequest, make_plan
from openk3.planner.report import PlotUnavailable, render_json, render_text, write_plot
from openk3.planner.search import SLO, SearchSpace


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="capacity planner: accelerators, latency, cost per token, and what binds",
        description="Plan a deployment of a K3-class model: memory per accelerator, decode/prefill step time, "
        "throughput, TTFT, tokens per joule, $ per 1M tokens, and the cheapest layout meeting SLOs.",
    )
    p.add_argument("--model", default="k3", help=f"model preset: {', '.join(sorted(MODELS))} (default k3)")
    p.add_argument("--hardware", default="gb300-nvl72", help="system name from the catalogue (default gb300-nvl72)")
    p.add_argument("--catalogue", default=None, help="extra JSON/YAML catalogue file adding or overriding systems")
    p.add_argument("--context", default="32k", help="tokens cached per sequence, e.g. 32k, 128k, 1m (default 32k)")
    p.add_argument("--prompt", default=None, help="prompt length for TTFT (default: the context)")
    p.add_argument("--concurrency", type=int, default=None, help="sequences decoding at once (default: the cheapest batch meeting the SLO)")
    p.add_argument("--quant", default="mxfp4", help="mxfp4 (K3 release), mxfp4-fp8, mxfp4-w4a4, fp8, bf16 (default mxfp4)")
    p.add_argument("--accelerators", type=int, default=None, help="instance size (default: the cheapest size the search finds)")
    p.add_argument("--tp", type=int, default=None, help="trunk tensor parallelism, a divisor of the attention heads (default: searched; 1 = DP attention)")
    p.add_argument("--balance", default=None, choices=[b.value for b in Balance], help="expert balancing (default: searched, eplb or moonep)")
    p.add_argument("--redundant-experts", type=int, default=None, help="extra expert replicas in the instance (default: searched, 0 or one per rank)")
    p.add_argument("--price", type=float, default=None, help="USD per accelerator-hour (default: the catalogue's)")
    p.add_argument("--min-user-tok-s", type=float, default=0.0, help="SLO: decode tokens/s per user (default 0)")
    p.add_argument("--max-ttft", type=float, default=float("inf"), help="SLO: time to first token in seconds (default none)")
    p.add_argument("--max-accelerators", type=int, default=288, help="largest instance the search considers (default 288)")
    p.add_argument("--eff-hbm", type=float, default=None, help="HBM bandwidth efficiency (default 0.8)")
    p.add_argument("--eff-gemm", type=float, default=None, help="GEMM efficiency (default 0.5)")
    p.add_argument("--eff-attention", type=float, default=None, help="attention kernel efficiency (default 0.3)")
    p.add_argument("--comm-overlap", type=float, default=None, help="fraction of communication hidden (default 0.7)")
    p.add_argument("--ideal", action="store_true", help="pure roofline: every efficiency 1, communication hidden")
    p.add_argument("--fill", type=float, default=0.9, help="fraction of usable HBM the plan may fill (default 0.9)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--plot", default=None, metavar="PNG", help="write charts (needs the optional matplotlib extra)")
    p.set_defaults(func=run)
    return p


def _efficiency(args: argparse.Namespace) -> Efficiency:
    base = Efficiency.ideal() if args.ideal else Efficiency()
    changes = {
        k: v
        for k, v in (("hbm", args.eff_hbm), ("gemm", args.eff_gemm), ("attention", args.eff_attention), ("comm_overlap", args.comm_overlap))
        if v is not None
    }
    return Efficiency(**{**base.__dict__, **changes})


def build_request(args: argparse.Namespace) -> PlanRequest:
    system = load_catalogue(args.catalogue).system(args.hardware)
    if args.price is not None:
        system = system.with_price(args.price)
    return PlanRequest(
        config=model_by_name(args.model),
        system=system,
        context=parse_tokens(args.context),
        concurrency=args.concurrency,
        prompt=parse_tokens(args.prompt) if args.prompt else None,
        quant=Quantisation.named(args.quant),
        accelerators=args.accelerators,
        tp=args.tp,
        balance=Balance(args.balance) if args.balance else None,
        redundant_experts=args.redundant_experts,
        slo=SLO(min_user_tok_s=args.min_user_tok_s, max_ttft_s=args.max_ttft),
        efficiency=_efficiency(args),
        fill=args.fill,
        space=SearchSpace(max_accelerators=args.max_accelerators),
    )


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 with a plan, 1 when no layout fits or meets the SLO (the reason is printed), 2 on a bad input."""
    try:
        plan = make_plan(build_request(args))
    except (ValueError, OSError) as exc:
        print(f"openk3 plan: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(render_json(plan), indent=2, allow_nan=False))
    else:
        print(render_text(plan))
    if plan.problem is not None:
        print(f"openk3 plan: no plan: {plan.problem}", file=sys.stderr)
        return 1
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

"""`openk3 bench serve`: the load-generating benchmark client of an OpenAI-compatible server."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    b = subparsers.add_parser("bench", help="benchmarks")
    bench_sub = b.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    from openk3.api.bench import add_arguments, run_cli

    bs = bench_sub.add_parser("serve", help="load an OpenAI-compatible server and report TTFT, TPOT, ITL, E2E latency, throughput, goodput")
    add_arguments(bs)
    bs.set_defaults(func=run_cli)

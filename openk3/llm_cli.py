"""`openk3 generate`: offline generation from the command line, through `LLM`."""

from __future__ import annotations

import argparse
import json
import sys

from openk3.launch.flags import add_engine_arguments, add_process_arguments, engine_configs
from openk3.serve.sampling import SamplingParams

ENGINE_FLAGS_NOT_TAKEN = ("seed",)  # --seed here is the sampling seed; the engine's own stays at its default


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text for one or more prompts, offline")
    p.add_argument("--model", default="tiny", help="preset name (tiny, debug) or checkpoint folder")
    p.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling (the engine's own seed stays 0)")
    p.add_argument("--stop", action="append", default=[], help="a stop string; repeatable")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt (text, token ids, finish reason, timings)")
    add_engine_arguments(p, exclude=ENGINE_FLAGS_NOT_TAKEN)
    add_process_arguments(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openk3.llm import LLM
    from openk3.serve.cpu_heap import apply_heap_mode

    apply_heap_mode(args.cpu_heap)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
        config, parallel = engine_configs(args, exclude=ENGINE_FLAGS_NOT_TAKEN)
        llm = LLM(args.model, config=config, parallel=parallel)
        try:
            outputs = llm.generate(args.prompt, params)
        finally:
            llm.close()
    except ValueError as e:
        print(f"openk3 generate: {e}", file=sys.stderr)
        return 2
    for out in outputs:
        c = out.outputs[0]
        m = c.metrics
        assert m is not None  # every sample of a finished output has its metrics
        if args.json:
            record = {
                "prompt": out.prompt,
                "text": c.text,
                "token_ids": list(c.token_ids),
                "finish_reason": c.finish_reason,
                "time_to_first_token_s": m.time_to_first_token,
                "e2e_latency_s": m.e2e_latency,
            }
            print(json.dumps(record))
        else:
            print(f"{out.prompt!r} -> {c.text!r} [{c.finish_reason}, {len(c.token_ids)} tokens, {m.e2e_latency:.3f}s]")
    return 0

"""`openk3 serve` (the OpenAI-compatible server) and `openk3 bench serve` (the load-generating benchmark client)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from openk3.serve.cli import add_prefix_cache_arguments, prefix_cache_options


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", default="tiny", help="preset name (tiny, debug) or checkpoint folder; default: the embedded demo model")
    p.add_argument("--served-model-name", default=None, help="the name clients use in 'model' (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("OPENK3_API_KEY"), help="require 'Authorization: Bearer KEY' on /v1 (env OPENK3_API_KEY)")
    p.add_argument("--max-model-len", type=int, default=None, help="longest prompt + completion in tokens (default: what the model and cache allow)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests in the running batch (= KDA state slots)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one engine step")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None, help="prefill chunk size per request and step")
    p.add_argument("--page-size", type=int, default=16, help="tokens per MLA cache page")
    p.add_argument("--cache-memory-mb", type=int, default=256, help="memory for MLA pages and KDA state slots")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0, help="seed of the preset's random weights and of unseeded sampling")
    add_prefix_cache_arguments(p)
    p.add_argument("--chat-template", type=Path, default=None, help="a Jinja chat template file (default: the model's own, else ChatML)")
    p.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body accepted (larger: HTTP 413)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's own choice)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish on shutdown")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.set_defaults(func=run)

    b = subparsers.add_parser("bench", help="benchmarks")
    bench_sub = b.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    from openk3.api.bench import add_arguments, run_cli

    bs = bench_sub.add_parser("serve", help="load an OpenAI-compatible server and report TTFT, TPOT, ITL, E2E latency, throughput, goodput")
    add_arguments(bs)
    bs.set_defaults(func=run_cli)


def build_server(args: argparse.Namespace):
    """The FastAPI app for parsed `serve` arguments (also used by tests and benchmarks/serve.py)."""
    import torch

    from openk3.api.chat import generation_stop_ids, load_chat_template
    from openk3.api.server import ServerConfig, create_app
    from openk3.serve.engine import EngineConfig, LLMEngine
    from openk3.serve.llm import ASSETS, build_model

    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    model, tokenizer = build_model(args.model, getattr(torch, args.dtype), args.device, args.seed)
    model_dir = Path(args.model) if Path(args.model).is_dir() else ASSETS / str(args.model)
    folder = model_dir if model_dir.is_dir() else None
    template = load_chat_template(folder, args.chat_template)
    engine = LLMEngine(
        model,
        tokenizer,
        EngineConfig(
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            page_size=args.page_size,
            cache_memory_bytes=args.cache_memory_mb * 2**20,
            seed=args.seed,
            **prefix_cache_options(args),
        ),
    )
    config = ServerConfig(
        model_name=args.served_model_name or str(args.model),
        model_root=str(args.model),
        api_key=args.api_key,
        max_body_bytes=int(args.max_body_mb * 2**20),
        shutdown_timeout_s=args.shutdown_timeout,
        stop_token_ids=generation_stop_ids(folder),
    )
    return create_app(engine, tokenizer, template, config)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app = build_server(args)
    except ValueError as e:
        print(f"openk3 serve: {e}", file=sys.stderr)
        return 2
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout)
    return 0

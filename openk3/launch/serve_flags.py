"""Every `openk3 serve` flag, in one place: the model's, the engine's (launch/flags.py), the HTTP server's
(api/server_flags.py), the process's, and scale-out's (scale/cli.py). The replicas parse the same flags."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from openk3.api.server_flags import add_server_arguments
from openk3.launch.flags import add_engine_arguments, add_process_arguments
from openk3.scale import cli as scale_cli


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="preset name (tiny, debug) or checkpoint folder; default: the embedded demo model")
    p.add_argument("--served-model-name", default=None, help="the name clients use in 'model' (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("OPENK3_API_KEY"), help="require 'Authorization: Bearer KEY' on /v1 (env OPENK3_API_KEY)")
    add_engine_arguments(p)
    add_server_arguments(p)
    add_process_arguments(p)
    p.add_argument("--chat-template", type=Path, default=None, help="a Jinja chat template file (default: the model's own or K3's encoding, else ChatML)")
    p.add_argument(
        "--default-chat-template-kwargs",
        type=_json_object,
        default={},
        help="chat_template_kwargs every chat request gets unless it sets the key itself, as JSON (e.g. '{\"thinking\": false}')",
    )
    p.add_argument(
        "--speculative-config",
        type=_json_object,
        default=None,
        help='vLLM\'s speculative decoding flag, as JSON: {"method": "draft_model", "model": PATH, "num_speculative_tokens": K} '
        '(the same as --speculative-model PATH --num-speculative-tokens K) or {"method": "mtp", "num_speculative_tokens": K} '
        "(the served checkpoint's own multi-token-prediction layer; the same as --speculative-method mtp) or "
        '{"method": "eagle3", "model": HEAD_FOLDER, "num_speculative_tokens": K} (an EAGLE-3 draft head); each may add '
        '"disable_by_batch_size": N (no drafts in a step that begins with N or more running requests)',
    )
    p.add_argument(
        "--tokenizer",
        choices=("auto", "byte"),
        default="auto",
        help="auto: the checkpoint's own (tokenizer.json or Kimi's tiktoken.model; a folder without one is an error); "
        "byte: the byte tokenizer, with the checkpoint's bos/eos ids",
    )
    p.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body accepted (larger: HTTP 413)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads (default: torch's own choice)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests get to finish on shutdown")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    scale_cli.add_arguments(p)


def parse_serve_arguments(argv: list[str]) -> argparse.Namespace:
    """`openk3 serve` flags (engine, server, model) from an argument list, as `openk3 serve ARGV` would read them."""
    parser = argparse.ArgumentParser(prog="openk3 serve")
    add_serve_arguments(parser)
    return parser.parse_args(argv)

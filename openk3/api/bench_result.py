"""The result file of `openk3 bench serve`, as `vllm bench serve --save-result` writes it: the run's identity (`date`,
`backend`, `label`, `model_id`, `tokenizer_id`, `num_prompts`, `request_rate` ("inf" for all at once), `burstiness`,
`max_concurrency`), any `--metadata`, then the measured summary and per-request arrays (api/bench_metrics.py), under
vLLM's file name `LABEL-RATEqps[-concurrencyC]-MODEL-DATE.json` unless one is given. Tools that read vLLM's result files
read these.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from typing import Any

from openk3.api.bench_args import metadata


def result_json(args: argparse.Namespace, model_id: str, summary: dict[str, Any], when: datetime.datetime) -> dict[str, Any]:
    head: dict[str, Any] = {
        "date": when.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": args.backend,
        "backend": args.backend,
        "label": args.label,
        "model_id": model_id,
        "tokenizer_id": args.tokenizer or model_id,
        "num_prompts": summary["num_prompts"],
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
    }
    head.update(metadata(args))
    rest = {k: v for k, v in summary.items() if k not in head}
    if rest.get("request_rate") == float("inf"):
        rest.pop("request_rate")
    return {**head, **rest}


def result_path(args: argparse.Namespace, model_id: str, when: datetime.datetime) -> str:
    """--save-result FILE, else --result-dir / (--result-filename or vLLM's generated name)."""
    if args.save_result:
        return str(args.save_result)
    if args.result_filename:
        name = args.result_filename
    else:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        name = f"{args.label or args.backend}-{args.request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{when.strftime('%Y%m%d-%H%M%S')}.json"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        return os.path.join(args.result_dir, name)
    return name


def save(args: argparse.Namespace, result: dict[str, Any]) -> str | None:
    """Write the result file when asked (--save-result, or --result-dir / --result-filename alone); its path, else None."""
    if args.save_result is None and args.result_dir is None and args.result_filename is None:
        return None
    when = datetime.datetime.strptime(result["date"], "%Y%m%d-%H%M%S")
    path = result_path(args, result["model_id"], when)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return path

"""`openk3 bench serve`: load an OpenAI-compatible server and measure what a client sees (the `vllm bench serve` method).

Per request, from the client's clock: TTFT (send -> first chunk carrying tokens), ITL (gaps between such chunks), E2EL (send ->
end of stream) and TPOT = (E2EL - TTFT) / (output_tokens - 1). Output tokens are the server's `usage` (stream_options.
include_usage), else the number of content chunks. Load is a seeded Poisson arrival process (`--request-rate`, default inf:
all at once) and/or a cap on requests in flight (`--max-concurrency`). Goodput counts requests that meet every SLO given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from openk3.api.bench_data import BenchRequest, DatasetConfig, ideal_prefix_hit_rate, make_requests, word_corpus

SLO_KEYS = ("ttft", "tpot", "e2el")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (the /v1 paths are appended)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", choices=("random", "prefix_repetition", "multiturn"), default="random")
    p.add_argument("--num-prompts", type=int, default=100, help="requests in all (multiturn: turns in all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--turn-len", type=int, default=32)
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 (keys: ttft, tpot, e2el)")
    p.add_argument("--save-result", default=None, help="write the results as JSON to this file")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


@dataclass
class RequestResult:
    success: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    reply: str = ""


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in SLO_KEYS:
            raise ValueError(f"--goodput {item!r}: the key must be one of {', '.join(SLO_KEYS)}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: the value must be a number of milliseconds") from None
    return slos


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    import numpy as np

    v = np.asarray(values_s or [0.0], dtype=np.float64) * 1000
    return {
        f"mean_{name}_ms": float(v.mean()),
        f"median_{name}_ms": float(np.median(v)),
        f"std_{name}_ms": float(v.std()),
        f"p90_{name}_ms": float(np.percentile(v, 90)),
        f"p99_{name}_ms": float(np.percentile(v, 99)),
    }


def tpot(r: RequestResult) -> float | None:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    tpots = [t for t in (tpot(r) for r in ok) if t is not None]
    total_in, total_out = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    good = 0
    for r in ok:
        measured = {"ttft": r.ttft * 1000, "tpot": (tpot(r) or 0.0) * 1000, "e2el": r.latency * 1000}
        good += all(measured[k] <= v for k, v in slos.items())
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "request_goodput": good / duration if slos else None,
        "goodput_slos_ms": slos,
    }
    for name, values in (("ttft", [r.ttft for r in ok]), ("tpot", tpots), ("itl", [x for r in ok for x in r.itl]), ("e2el", [r.latency for r in ok])):
        out.update(_stats(name, values))
    out["errors"] = sorted({r.error for r in results if r.error})[:10]
    return out


async def send(client, url: str, payload: dict, headers: dict) -> RequestResult:
    """One streaming request, timed from the client."""
    res, chat = RequestResult(), "messages" in payload
    start = last = time.perf_counter()
    chunks, parts = 0, []
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"].get("message"))
                    return res
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"]["prompt_tokens"]
                    res.output_tokens = obj["usage"]["completion_tokens"]
                for c in obj.get("choices") or ():
                    delta = c.get("delta") or {}
                    if chat and delta.get("role"):
                        continue  # the role chunk comes with the first content chunk; count tokens, not the announcement
                    now = time.perf_counter()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    parts.append((delta.get("content") if chat else c.get("text")) or "")
        res.latency = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.reply = "".join(parts)
        res.success = chunks > 0 or res.output_tokens == 0
        if not res.success:
            res.error = "the stream carried no tokens"
    except Exception as e:  # a failed request is a result, not the end of the benchmark
        res.error = f"{type(e).__name__}: {e}"
    return res


async def _token_pool(client, base: str, model: str, headers: dict, seed: int) -> list[int] | None:
    try:
        body = {"model": model, "prompt": word_corpus(random.Random(seed), 2000), "add_special_tokens": False}
        r = await client.post(f"{base}/tokenize", json=body, headers=headers)
    except Exception:
        return None
    return r.json().get("tokens") if r.status_code == 200 else None


async def benchmark(args: argparse.Namespace) -> dict:
    import httpx
    from tqdm import tqdm

    slos = parse_goodput(args.goodput)
    cfg = DatasetConfig(
        args.dataset,
        args.num_prompts,
        args.seed,
        args.input_len,
        args.output_len,
        args.range_ratio,
        args.prefix_len,
        args.suffix_len,
        args.num_prefixes,
        args.num_turns,
        args.turn_len,
    )
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get(f"{base}/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        pool = None if cfg.name == "multiturn" else await _token_pool(client, base, model, headers, cfg.seed)
        work = make_requests(cfg, pool)
        total = sum(len(w.turns) for w in work) if cfg.name == "multiturn" else len(work)
        bar = tqdm(total=total, disable=args.disable_tqdm, desc="bench serve", file=sys.stderr)
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        results: list[RequestResult] = []

        async def one(payload: dict, path: str) -> RequestResult:
            if gate is None:
                res = await send(client, base + path, payload, headers)
            else:
                async with gate:
                    res = await send(client, base + path, payload, headers)
            results.append(res)
            bar.update(1)
            return res

        common = {"model": model, "max_tokens": None, "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

        async def run_one(w: BenchRequest) -> None:
            if not w.turns:
                await one({**common, "prompt": w.prompt, "max_tokens": w.output_len}, "/v1/completions")
                return
            messages: list[dict] = []
            for turn in w.turns:
                messages.append({"role": "user", "content": turn})
                res = await one({**common, "messages": list(messages), "max_tokens": w.output_len}, "/v1/chat/completions")
                if not res.success:
                    return
                messages.append({"role": "assistant", "content": res.reply})

        rng = random.Random(args.seed)
        start = time.perf_counter()
        tasks = []
        for w in work:
            tasks.append(asyncio.ensure_future(run_one(w)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    out = summarize(results, duration, slos)
    out.update(
        dataset=cfg.name,
        dataset_config=asdict(cfg),
        model=model,
        base_url=base,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        num_prompts=total,
    )
    if cfg.name == "prefix_repetition":
        out["ideal_prefix_hit_rate"] = ideal_prefix_hit_rate(cfg)
    return out


def format_table(result: dict) -> str:
    rows = [
        ("Successful requests", result["completed"]),
        ("Failed requests", result["failed"]),
        ("Duration (s)", result["duration"]),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total output tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", result["request_throughput"]),
        ("Output token throughput (tok/s)", result["output_throughput"]),
        ("Total token throughput (tok/s)", result["total_token_throughput"]),
    ]
    if result["request_goodput"] is not None:
        rows.append(("Request goodput (req/s)", result["request_goodput"]))
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "p90", "p99"):
            rows.append((f"{stat.capitalize()} {name.upper()} (ms)", result[f"{stat}_{name}_ms"]))
    return "\n".join(f"{k:<34}{v:>12.2f}" if isinstance(v, float) else f"{k:<34}{v:>12}" for k, v in rows)


def run_cli(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(benchmark(args))
    except ValueError as e:
        print(f"openk3 bench serve: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    for error in result["errors"]:
        print(f"error: {error}", file=sys.stderr)
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["completed"] > 0 else 1

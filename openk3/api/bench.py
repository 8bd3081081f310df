"""`openk3 bench serve`: load an OpenAI-compatible server and measure what a client sees (the `vllm bench serve` method).

Per request, from the client's clock: TTFT (send -> first chunk carrying tokens), ITL (gaps between such chunks), E2EL (send ->
end of stream) and TPOT = (E2EL - TTFT) / (output_tokens - 1). Output tokens are the server's `usage` (stream_options.
include_usage), else the number of content chunks. Load is a seeded gamma arrival process (`--request-rate`, default inf: all
at once; `--burstiness`, 1: Poisson) and/or a cap on requests in flight (`--max-concurrency`). Goodput counts requests that
meet every SLO given. The arithmetic and the table are in bench_metrics.py, the workloads in bench_data.py.

A server that cannot be reached ends the run before it starts with one line (exit 1); a run where every request failed prints
N/A for what it could not measure and exits 1; bad arguments exit 2. The clock, the sleeper and the HTTP transport are
parameters of `benchmark`, so tests run it against a fake server in fake time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

from openk3.api.bench_args import CHAT_BACKENDS, add_arguments, base_url, endpoint, metadata
from openk3.api.bench_data import (
    BenchRequest,
    DatasetConfig,
    arrival_intervals,
    ideal_prefix_hit_rate,
    make_requests,
    sharegpt_requests,
    word_corpus,
)
from openk3.api.bench_metrics import RequestResult, format_table, parse_goodput, parse_metric_percentiles, parse_percentile_metrics, summarize
from openk3.api.bench_result import result_json, save

__all__ = ["BenchError", "add_arguments", "benchmark", "run_cli", "send"]

Clock = Callable[[], float]
Sleep = Callable[[float], Awaitable[Any]]


class BenchError(Exception):
    """The server cannot be used at all (unreachable, no model to name, no /tokenize for a ShareGPT file)."""


async def send(client, url: str, payload: dict, headers: dict, clock: Clock = time.perf_counter, prompt_len: int = 0) -> RequestResult:
    """One streaming request, timed from the client."""
    res, chat = RequestResult(prompt_tokens=prompt_len), "messages" in payload
    res.start = start = last = clock()
    chunks, parts = 0, []
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                res.end = clock()
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
                    res.end = clock()
                    return res
                if obj.get("usage"):
                    res.prompt_tokens = obj["usage"]["prompt_tokens"]
                    res.output_tokens = obj["usage"]["completion_tokens"]
                for c in obj.get("choices") or ():
                    delta = c.get("delta") or {}
                    if chat and delta.get("role"):
                        continue  # the role chunk comes with the first content chunk; count tokens, not the announcement
                    now = clock()
                    if chunks == 0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    parts.append((delta.get("content") if chat else c.get("text")) or "")
        res.latency = clock() - start
        res.output_tokens = res.output_tokens or chunks
        res.reply = "".join(parts)
        res.success = chunks > 0 or res.output_tokens == 0
        if not res.success:
            res.error = "the stream carried no tokens"
    except Exception as e:  # a failed request is a result, not the end of the benchmark
        res.error = f"{type(e).__name__}: {e}"
    res.end = clock()  # a failed request held its place in flight too (peak concurrency)
    return res


async def _model_or_fail(client, base: str, headers: dict, model: str | None, timeout: float) -> str:
    """Reach the server once before the run (any answer will do when --model is given); name its first model otherwise."""
    import httpx

    try:
        r = await client.get(f"{base}/v1/models", headers=headers, timeout=timeout)
    except (httpx.TransportError, httpx.InvalidURL) as e:
        raise BenchError(f"cannot reach the server at {base} ({type(e).__name__}: {e}); is it running, and is --base-url right?") from None
    if model is not None:
        return model
    if r.status_code != 200:
        hint = " (pass --api-key)" if r.status_code == 401 else " (pass --model)"
        raise BenchError(f"GET {base}/v1/models answered HTTP {r.status_code}: {r.text[:200]!r}{hint}")
    try:
        return str(r.json()["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(f"GET {base}/v1/models names no model: {r.text[:200]!r} (pass --model)") from None


async def _token_pool(client, base: str, model: str, headers: dict, seed: int) -> list[int] | None:
    try:
        body = {"model": model, "prompt": word_corpus(random.Random(seed), 2000), "add_special_tokens": False}
        r = await client.post(f"{base}/tokenize", json=body, headers=headers)
    except Exception:
        return None
    return r.json().get("tokens") if r.status_code == 200 else None


def _token_counter(client, base: str, model: str, headers: dict) -> Callable[[list[str], bool], Awaitable[list[int]]]:
    """The server's token count of each text (ShareGPT lengths), through /tokenize."""
    import httpx

    async def one(text: str, special: bool) -> int:
        why = "--dataset sharegpt measures lengths with the server's /tokenize"
        try:
            r = await client.post(f"{base}/tokenize", json={"model": model, "prompt": text, "add_special_tokens": special}, headers=headers)
        except httpx.HTTPError as e:
            raise BenchError(f"{why}, which failed: {type(e).__name__}: {e}") from None
        if r.status_code != 200:
            raise BenchError(f"{why}, which answered HTTP {r.status_code}: {r.text[:200]!r}")
        body = r.json()
        return int(body["count"]) if "count" in body else len(body["tokens"])

    async def count(texts: list[str], special: bool) -> list[int]:
        return list(await asyncio.gather(*(one(t, special) for t in texts)))

    return count


async def _as_text(client, base: str, model: str, headers: dict, w: BenchRequest) -> BenchRequest:
    if not isinstance(w.prompt, list):
        return w
    r = await client.post(f"{base}/detokenize", json={"model": model, "tokens": w.prompt}, headers=headers)
    if r.status_code != 200:
        raise BenchError(f"--backend openai-chat spells token prompts out with the server's /detokenize, which answered HTTP {r.status_code}: {r.text[:200]!r}")
    return dataclasses.replace(w, prompt=str(r.json()["prompt"]), prompt_len=len(w.prompt))


def dataset_config(args: argparse.Namespace) -> DatasetConfig:
    return DatasetConfig(
        name=args.dataset,
        num_prompts=args.num_prompts,
        seed=args.seed,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        suffix_len=args.suffix_len,
        num_prefixes=args.num_prefixes,
        num_turns=args.num_turns,
        turn_len=args.turn_len,
        dataset_path=args.dataset_path,
        sharegpt_output_len=args.sharegpt_output_len,
    )


async def benchmark(args: argparse.Namespace, transport: Any = None, clock: Clock = time.perf_counter, sleep: Sleep = asyncio.sleep) -> dict:
    """Run the benchmark; `transport` (an httpx async transport), `clock` and `sleep` replace the network and time in tests."""
    import httpx
    from tqdm import tqdm

    slos = parse_goodput(args.goodput)
    metrics, percentiles = parse_percentile_metrics(args.percentile_metrics), parse_metric_percentiles(args.metric_percentiles)
    cfg = dataset_config(args)
    arrival_intervals(1, args.request_rate, args.burstiness, args.seed)  # bad values stop here, before the server is asked
    route, chat_backend = endpoint(args), args.backend in CHAT_BACKENDS
    metadata(args)
    base = base_url(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # an injected transport is the whole network: proxy variables from the environment must not route around it
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout), limits=limits, transport=transport, trust_env=transport is None) as client:
        model = await _model_or_fail(client, base, headers, args.model, min(args.timeout, 30.0))
        if cfg.name == "sharegpt":
            work = await sharegpt_requests(cfg, _token_counter(client, base, model, headers))
        else:
            work = make_requests(cfg, None if cfg.name == "multiturn" else await _token_pool(client, base, model, headers, cfg.seed))
        if chat_backend:  # a chat message is text: token-id prompts are spelled out by the server's /detokenize
            work = list(await asyncio.gather(*(_as_text(client, base, model, headers, w) for w in work)))
        total = sum(len(w.turns) for w in work) if cfg.name == "multiturn" else len(work)
        bar = tqdm(total=total, disable=args.disable_tqdm, desc="bench serve", file=sys.stderr)
        gate = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        results: list[RequestResult] = []  # in the order sent

        async def one(payload: dict, path: str, prompt_len: int) -> RequestResult:
            slot = len(results)
            results.append(RequestResult())
            if gate is None:
                res = await send(client, base + path, payload, headers, clock, prompt_len)
            else:
                async with gate:
                    res = await send(client, base + path, payload, headers, clock, prompt_len)
            results[slot] = res
            bar.update(1)
            return res

        common = {"model": model, "temperature": 0.0, "ignore_eos": args.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}

        async def run_one(w: BenchRequest) -> None:
            if not w.turns and chat_backend:
                message = {"role": "user", "content": w.prompt}
                await one({**common, "messages": [message], "max_completion_tokens": w.output_len}, route, 0)
                return
            if not w.turns:
                known = w.input_len if isinstance(w.prompt, list) or w.prompt_len is not None else 0
                await one({**common, "prompt": w.prompt, "max_tokens": w.output_len}, route, known)
                return
            messages: list[dict] = []
            for turn in w.turns:
                messages.append({"role": "user", "content": turn})
                res = await one({**common, "messages": list(messages), "max_tokens": w.output_len}, "/v1/chat/completions", 0)
                if not res.success:
                    return
                messages.append({"role": "assistant", "content": res.reply})

        gaps = arrival_intervals(len(work), args.request_rate, args.burstiness, args.seed)
        start = clock()
        tasks = []
        for i, w in enumerate(work):
            tasks.append(asyncio.ensure_future(run_one(w)))
            if i < len(gaps) and gaps[i] > 0:
                await sleep(gaps[i])
        await asyncio.gather(*tasks)
        duration = clock() - start
        bar.close()
    out = summarize(results, duration, slos, percentiles)
    out.update(
        dataset=cfg.name,
        dataset_config=asdict(cfg),
        model=model,
        base_url=base,
        endpoint=route,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        num_prompts=total,
        percentile_metrics=metrics,
    )
    if cfg.name == "prefix_repetition":
        out["ideal_prefix_hit_rate"] = ideal_prefix_hit_rate(cfg)
    return result_json(args, model, out, datetime.datetime.now())


def run_cli(args: argparse.Namespace, transport: Any = None) -> int:
    try:
        result = asyncio.run(benchmark(args, transport))
    except ValueError as e:
        print(f"openk3 bench serve: {e}", file=sys.stderr)
        return 2
    except BenchError as e:
        print(f"openk3 bench serve: {e}", file=sys.stderr)
        return 1
    print(format_table(result, result["percentile_metrics"]))
    for error in result["error_kinds"]:
        print(f"error: {error}", file=sys.stderr)
    try:
        path = save(args, result)
    except OSError as e:
        print(f"openk3 bench serve: cannot write the result file: {e}", file=sys.stderr)
        return 1
    if path is not None:
        print(f"results saved to {path}", file=sys.stderr)
    if result["completed"] == 0:
        print(f"openk3 bench serve: all {result['failed']} requests failed; nothing was measured", file=sys.stderr)
        return 1
    return 0

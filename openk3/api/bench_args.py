"""`openk3 bench serve`'s flags, under `vllm bench serve`'s names so that its command lines run unchanged (`--backend`,
`--endpoint`, `--host`/`--port`, `--dataset-name`, `--random-input-len`, `--save-result` with `--result-dir` and
`--result-filename`, ...), and their checks, made before any request is sent.

`--backend openai` (or `vllm`) sends each prompt to the completions route, `--backend openai-chat` as one user message to the
chat route (`--endpoint` defaults to the backend's route; a route that does not match the backend is refused, as vLLM does).
The multiturn dataset is a conversation and always uses the chat route.
"""

from __future__ import annotations

import argparse

from openk3.api.bench_data import DATASETS

BACKENDS = {"openai": "/v1/completions", "vllm": "/v1/completions", "openai-chat": "/v1/chat/completions"}  # -> the default endpoint
CHAT_BACKENDS = ("openai-chat",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="server root (the /v1 paths are appended); default http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--backend", choices=tuple(BACKENDS), default="openai", help="openai (or vllm): the completions route; openai-chat: the chat route")
    p.add_argument("--endpoint", default=None, help="the route requests go to (default: the backend's, /v1/completions or /v1/chat/completions)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    p.add_argument(
        "--tokenizer", default=None, help="recorded as tokenizer_id (default: the model); prompts are always made and counted with the server's /tokenize"
    )
    p.add_argument("--label", default=None, help="the result file's name prefix (default: the backend)")
    p.add_argument("--api-key", default=None)
    # the second names are `vllm bench serve`'s, so its command lines run unchanged
    p.add_argument("--dataset", "--dataset-name", dest="dataset", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", default=None, help="sharegpt: a ShareGPT-format JSON file")
    p.add_argument("--sharegpt-output-len", type=int, default=None, help="sharegpt: output length of every request (default: the reply's)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests in all (multiturn: turns in all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="arrivals per second (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps between arrivals (1: Poisson; < 1 burstier)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128)
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=64)
    p.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--num-prefixes", type=int, default=4)
    p.add_argument("--num-turns", type=int, default=4)
    p.add_argument("--turn-len", type=int, default=32)
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos, so each request makes exactly its output length (default: on; --no-ignore-eos lets EOS end it)",
    )
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="metrics the table shows, of ttft,tpot,itl,e2el")
    p.add_argument("--metric-percentiles", default="99", help="percentiles of each metric, e.g. 50,90,99")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS", help="SLOs, e.g. ttft:500 tpot:50 (keys: ttft, tpot, e2el)")
    p.add_argument(
        "--save-result",
        nargs="?",
        const="",
        default=None,
        metavar="FILE",
        help="write the results as JSON (vLLM's fields, with the per-request arrays): to FILE, else --result-dir/--result-filename, "
        "else vLLM's name BACKEND-RATEqps[-concurrencyC]-MODEL-DATE.json",
    )
    p.add_argument("--result-dir", default=None, help="folder of the result file (made if missing)")
    p.add_argument("--result-filename", default=None, help="name of the result file")
    p.add_argument("--save-detailed", action="store_true", help="accepted for vLLM's command lines: the per-request arrays are always saved")
    p.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="extra fields for the result file")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")


def base_url(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def endpoint(args: argparse.Namespace) -> str:
    """The route of every single-prompt request, checked against the backend (a ValueError names both flags)."""
    route = args.endpoint or BACKENDS[args.backend]
    chat = route.rstrip("/").endswith("chat/completions")
    if (args.backend in CHAT_BACKENDS) != chat:
        want = "end with chat/completions" if args.backend in CHAT_BACKENDS else "be a completions route, not chat/completions"
        raise ValueError(f"--endpoint {route!r} with --backend {args.backend}: the route must {want}")
    return route


def metadata(args: argparse.Namespace) -> dict[str, str]:
    out = {}
    for item in args.metadata or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--metadata {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out

"""lm-evaluation-harness end to end against `openk3 serve`: a multiple-choice task scored by loglikelihood (echo + logprobs
on /v1/completions, the path of MMLU, HellaSwag, ARC ...) and a generate_until task, through lm-eval's own
`local-completions` and `local-chat-completions` clients.

lm-eval is a heavy client and not a project dependency: install it into a venv of its own and name its Python, e.g.
    python -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install lm-eval
    .venv/bin/python benchmarks/lm_eval_local.py --lm-eval-python /tmp/lmeval/bin/python [--model tiny] [--out FILE.md]

Nothing is downloaded: the tasks are written here (YAML + a jsonl of items made up below), lm-eval reads them with
`--include_path`, and local-completions tokenizes through the server (GET /tokenizer_info, POST /tokenize). Correctness
first: every loglikelihood lm-eval logged for the first document is recomputed here from a direct /v1/completions echo
request and from the offline engine (`LLM`, the same model and seed), and the run fails unless all three agree to 1e-4.
The output is lm-eval's own result tables and the check, with the exact commands.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]

# (question, four choices, index of the right one): made up here, small enough to read
MC_ITEMS = [
    ("What is the capital of France?", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("How many legs does a spider have?", ["six", "eight", "four", "ten"], 1),
    ("Which planet is closest to the Sun?", ["Venus", "Earth", "Mercury", "Mars"], 2),
    ("What colour is the sky on a clear day?", ["green", "red", "yellow", "blue"], 3),
    ("What is two plus two?", ["four", "three", "five", "six"], 0),
    ("Which animal says moo?", ["dog", "cow", "cat", "duck"], 1),
    ("What do bees make?", ["milk", "silk", "honey", "wax paper"], 2),
    ("Water freezes at how many degrees Celsius?", ["100", "50", "10", "0"], 3),
    ("Which is the largest ocean?", ["Pacific", "Atlantic", "Indian", "Arctic"], 0),
    ("What is the opposite of hot?", ["warm", "cold", "wet", "loud"], 1),
]
GEN_ITEMS = [
    ("The capital of France is", "Paris"),
    ("One, two, three, four,", "five"),
    ("Monday, Tuesday,", "Wednesday"),
    ("Red, green and", "blue"),
    ("A, B, C,", "D"),
    ("The sun rises in the", "east"),
    ("Cats and", "dogs"),
    ("Salt and", "pepper"),
    ("January, February,", "March"),
    ("Ten, nine, eight,", "seven"),
]

MC_YAML = """task: openk3_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

GEN_YAML = """task: openk3_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
filter_list:
  - name: first_word
    filter:
      - function: regex
        regex_pattern: "(\\\\w+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""


def write_tasks(folder: Path) -> None:
    with open(folder / "mc.jsonl", "w") as f:
        for q, choices, answer in MC_ITEMS:
            f.write(json.dumps({"question": q, "choices": choices, "answer": answer}) + "\n")
    with open(folder / "gen.jsonl", "w") as f:
        for prompt, target in GEN_ITEMS:
            f.write(json.dumps({"prompt": prompt, "answer": target}) + "\n")
    (folder / "openk3_mc.yaml").write_text(MC_YAML.format(data=folder / "mc.jsonl"))
    (folder / "openk3_gen.yaml").write_text(GEN_YAML.format(data=folder / "gen.jsonl"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str, seed: int, port: int, threads: int | None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "openk3", "serve", "--model", model, "--port", str(port), "--seed", str(seed), "--log-level", "warning"]
    if threads is not None:
        cmd += ["--torch-threads", str(threads)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"openk3 serve exited with {proc.returncode}: {proc.stderr.read()[-2000:] if proc.stderr else ''}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("openk3 serve did not come up within 300 s")


def run_lm_eval(python: str, client: str, url: str, model: str, tasks: str, include: Path, out: Path, extra: list[str]) -> tuple[list[str], str]:
    model_args = f"model={model},base_url={url},num_concurrent=1,max_retries=1,timeout=300"
    cmd = [python, "-m", "lm_eval", "run", "--model", client, "--model_args", model_args, "--tasks", tasks]
    cmd += ["--include_path", str(include), "--output_path", str(out), "--log_samples", "--seed", "0", *extra]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"lm_eval ({client}) exited with {done.returncode}:\n{done.stderr[-4000:]}")
    return cmd, done.stdout


def logged_samples(out: Path, task: str) -> list[dict]:
    (path,) = sorted(out.rglob(f"samples_{task}_*.jsonl"))[-1:]
    return [json.loads(line) for line in path.read_text().splitlines()]


def server_loglikelihood(base: str, model: str, context: str, continuation: str) -> float:
    """The continuation's summed logprob, from one echo request the way local-completions asks (token ids in, max_tokens 1)."""
    tok = lambda text: httpx.post(f"{base}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]  # noqa: E731
    ctx, whole = tok(context), tok(context + continuation)
    cont = whole[len(ctx) :]  # lm-eval's split: the whole string tokenized once, the context's length cut off
    body = {"model": model, "prompt": ctx + cont, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    (choice,) = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["choices"]
    return float(sum(choice["logprobs"]["token_logprobs"][len(ctx) : len(ctx) + len(cont)]))


def engine_loglikelihood(llm: Any, context: str, continuation: str) -> float:
    """The same sum from the offline engine's own forward (prompt_logprobs), no HTTP at all."""
    from openk3.serve.sampling import SamplingParams

    tokenizer = llm.tokenizer
    ctx, whole = tokenizer.encode(context), tokenizer.encode(context + continuation)
    (out,) = llm.generate([whole], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
    rows = out.prompt_logprobs  # one per prompt token after the first
    assert rows is not None and [r.token_id for r in rows] == whole[1:]
    return float(sum(r.logprob for r in rows[len(ctx) - 1 :]))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lm-eval-python", required=True, help="the Python of a venv with lm-eval installed")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--out", type=Path, default=None, help="also write the report (markdown) here")
    args = p.parse_args()

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = start_server(args.model, args.seed, port, args.torch_threads)
    report: list[str] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            write_tasks(folder)
            runs = [
                ("local-completions", f"{base}/v1/completions", "openk3_mc,openk3_gen", ["--batch_size", "4"]),
                ("local-chat-completions", f"{base}/v1/chat/completions", "openk3_gen", ["--apply_chat_template"]),
            ]
            for client, url, tasks, extra in runs:
                started = time.perf_counter()
                cmd, stdout = run_lm_eval(args.lm_eval_python, client, url, args.model, tasks, folder, folder / client, extra)
                took = time.perf_counter() - started
                shown = " ".join(c if c != str(folder) and not c.startswith(tmp) else "<tasks>" for c in cmd[1:])
                report += [f"### `{client}` ({tasks}), {took:.0f} s", "", f"    lm_eval {shown.removeprefix('-m lm_eval ')}", ""]
                report += [line for line in stdout.splitlines() if line.startswith("|")] + [""]
            # the check: lm-eval's logged loglikelihoods of the first question, against the server and the engine
            (first,) = [s for s in logged_samples(folder / "local-completions", "openk3_mc") if s["doc_id"] == 0]
            rows = ["| choice | lm-eval | server echo | engine | max abs diff |", "|---|---|---|---|---|"]
            worst = 0.0
            from openk3.llm import LLM

            llm = LLM(args.model, seed=args.seed)
            for arg, resp in zip(first["arguments"].values(), first["resps"], strict=True):  # {"gen_args_0": {"arg_0": ...}}
                context, continuation = arg["arg_0"], arg["arg_1"]
                logged = float(resp[0][0])
                direct = server_loglikelihood(base, args.model, context, continuation)
                offline = engine_loglikelihood(llm, context, continuation)
                diff = max(abs(logged - direct), abs(logged - offline))
                worst = max(worst, diff)
                rows.append(f"| {continuation!r} | {logged:.5f} | {direct:.5f} | {offline:.5f} | {diff:.1e} |")
            report += ["### loglikelihood check (first question, every choice)", "", *rows, ""]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    head = [
        f"## lm-eval against `openk3 serve --model {args.model}`",
        "",
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}; "
        f"commit {subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT, capture_output=True, text=True).stdout.strip()}",
        f"command: python benchmarks/lm_eval_local.py --lm-eval-python <venv>/bin/python --model {args.model}",
        "",
    ]
    text = "\n".join(head + report)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    if worst > 1e-4:
        print(f"FAILED: lm-eval's loglikelihoods differ from the engine's by {worst:.1e} (> 1e-4)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The planner beside AIConfigurator (ai-dynamo/aiconfigurator, a test/benchmark dependency) on the cases both can run.

    .venv/bin/pip install aiconfigurator     # not a runtime dependency of openk3
    .venv/bin/python benchmarks/planner_aiconfigurator.py

AIConfigurator predicts from its bundled per-operator databases, offline (HF_HUB_OFFLINE=1; the model configs ship with
it). Its `estimate` runs one fixed layout; cases whose expert parallelism crosses a node it refuses (no cross-node
DeepEP data in 0.12.0), and the script prints its message for those. Prints one Markdown table and the exact command,
machine and commit. Pure CPU for both tools.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from openk3.planner.dtypes import with_dtypes
from openk3.planner.inputs import Layout, Workload
from openk3.planner.models import deepseek_v3
from openk3.planner.perf import Efficiency
from openk3.planner.validation import CASES, FP8, _eval

AIC = Path(sys.executable).with_name("aiconfigurator")
FP8_KV = with_dtypes(FP8, kv="fp8")  # AIConfigurator resolves DeepSeek-V3's KV cache to FP8; the planner is set the same


@dataclass(frozen=True)
class Row:
    name: str
    published: float | None
    metric: str
    aic_args: list[str]
    aic_metric: Callable[[dict[str, float]], float]
    planner: Callable[[], float]


def _published(name: str) -> float | None:
    return next((c.published for c in CASES if c.name == name), None)


def _run_aic(args: list[str]) -> dict[str, float] | str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    try:
        out = subprocess.run([str(AIC), "cli", "estimate", *args], capture_output=True, text=True, timeout=600, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"did not run: {exc}"
    text = out.stdout + out.stderr
    err = re.search(r"^(?:Error|RuntimeError): (.*)$", text, re.M)
    if out.returncode or err:
        return (err.group(1) if err else text.strip().splitlines()[-1])[:200]
    figures = {k: float(v.replace(",", "")) for k, v in re.findall(r"^\s+([A-Za-z/ .]+?):\s+([\d,.]+)", text, re.M)}
    return figures


def _ds_h200_decode() -> float:
    return _eval(Efficiency(), deepseek_v3(), FP8_KV, Layout(8, tp=1), Workload(context=2050, concurrency=1024, prompt=2000), "hgx-h200").per_accelerator_tok_s


def _ds_h200_prefill() -> float:
    return _eval(Efficiency(), deepseek_v3(), FP8_KV, Layout(8, tp=1), Workload(context=2000, concurrency=8, prompt=2000), "hgx-h200").prefill_tok_s / 8


def _case(name: str) -> Callable[[], float]:
    case = next(c for c in CASES if c.name == name)

    def run() -> float:
        value = case.predict()
        assert value is not None
        return value

    return run


DS = ["--model-path", "deepseek-ai/DeepSeek-V3", "--tp-size", "1", "--moe-tp-size", "1"]
EP2_PREFILL = "DeepSeek-R1 NVFP4, 2 GB300, EP2, prefill only"
ROWS = (
    Row(EP2_PREFILL + " (AIC: DeepSeek-V3.1-NVFP4, same architecture)", _published(EP2_PREFILL), "prefill tok/s/GPU",
        ["--model-path", "nvidia/DeepSeek-V3.1-NVFP4", "--system", "gb300", "--backend", "vllm", "--estimate-mode", "static_ctx",
         "--isl", "2048", "--osl", "1", "--batch-size", "128", "--tp-size", "1", "--attention-dp-size", "2", "--moe-ep-size", "2", "--moe-tp-size", "1"],
        lambda f: f["seq/s"] * 2048 / 2, _case(EP2_PREFILL)),
    Row("DeepSeek-V3, 8 H200, DEP8 decode, 128 seq/GPU at 2K", None, "decode tok/s/GPU",
        [*DS, "--system", "h200_sxm", "--backend", "sglang", "--estimate-mode", "static_gen", "--isl", "2000", "--osl", "100",
         "--batch-size", "128", "--attention-dp-size", "8", "--moe-ep-size", "8"],
        lambda f: f["tokens/s/gpu"], _ds_h200_decode),
    Row("DeepSeek-V3, 8 H200, DEP8 prefill, 2K prompts", None, "prefill tok/s/GPU",
        [*DS, "--system", "h200_sxm", "--backend", "sglang", "--estimate-mode", "static_ctx", "--isl", "2000", "--osl", "1",
         "--batch-size", "4", "--attention-dp-size", "8", "--moe-ep-size", "8"],
        lambda f: f["seq/s"] * 2000 / 8, _ds_h200_prefill),
    Row("DeepSeek-V3, 72 decode H100, EP72", _published("DeepSeek-V3, 72 decode H100 (9 nodes), EP72"), "decode tok/s/GPU",
        [*DS, "--system", "h100_sxm", "--backend", "sglang", "--estimate-mode", "static_gen", "--isl", "2000", "--osl", "100",
         "--batch-size", "128", "--attention-dp-size", "72", "--moe-ep-size", "72"],
        lambda f: f["tokens/s/gpu"], _case("DeepSeek-V3, 72 decode H100 (9 nodes), EP72")),
    Row("DeepSeek-V3, GB200 NVL72, EP48 decode", _published("DeepSeek-V3, GB200 NVL72 decode, BF16 attn + FP8 MoE"), "decode tok/s/GPU",
        [*DS, "--system", "gb200", "--backend", "trtllm", "--estimate-mode", "static_gen", "--isl", "2000", "--osl", "100",
         "--batch-size", "768", "--attention-dp-size", "48", "--moe-ep-size", "48"],
        lambda f: f["tokens/s/gpu"], _case("DeepSeek-V3, GB200 NVL72 decode, BF16 attn + FP8 MoE")),
)  # fmt: skip


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _err(x: float, ref: float | None) -> str:
    return "-" if ref is None else f"{x / ref - 1:+.0%}"


def main() -> int:
    print(f"command: python {' '.join(sys.argv)}; machine: {platform.machine()} {platform.system()}; commit {_commit()}")
    if not AIC.exists():
        print(f"aiconfigurator is not installed beside {sys.executable} (pip install aiconfigurator): no side-by-side")
        return 0
    print()
    print("| case | metric | published | planner | planner error | AIConfigurator | AIC error | AIC command |")
    print("|---|---|---|---|---|---|---|---|")
    for row in ROWS:
        ours = row.planner()
        aic = _run_aic(row.aic_args)
        pub = "-" if row.published is None else f"{row.published:,.0f}"
        cmd = "aiconfigurator cli estimate " + " ".join(row.aic_args)
        if isinstance(aic, str):
            cells = [f"not run: {aic}", "-"]
        else:
            value = row.aic_metric(aic)
            cells = [f"{value:,.0f}", _err(value, row.published)]
        print(f"| {row.name} | {row.metric} | {pub} | {ours:,.0f} | {_err(ours, row.published)} | {cells[0]} | {cells[1]} | `{cmd}` |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

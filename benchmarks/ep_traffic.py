"""Expert all-to-all traffic per decode run, measured on rank 0, against the planner's prediction (planner/comm.py).

Each layout runs the offline engine (`LLM(..., ep=W, ep_method="ep")`: the exact static exchange, experts contiguous,
per-destination de-duplication) on P prompts x T greedy tokens. This process is rank 0; its `ParallelContext.all_to_all`
is wrapped, and every MoE layer call's three all-to-alls are read as they go out:

- the counts ([W, 2 + G] int64: rows and entries per destination): tokens this rank dispatched (entries / top_k) and the
  de-duplicated copies it sent to other ranks (rows to destinations other than itself);
- the dispatch payload (rows + 20 B of metadata per entry: two int64 and one fp32 weight), bytes to other ranks;
- the combine (result rows back to their sources), bytes to other ranks.

The planner prices the same quantities for uniform routing (`copies_per_token(..., dedup=True)`: expected remote
destination ranks of one token; `dispatch_bytes_per_copy` / `combine_bytes_per_copy` at the run's activation width of
32 bits, and no metadata). Measured over planned is then the model's routing locality (below 1: a token's experts
cluster on fewer ranks than uniform routing would spread them) and the metadata the planner leaves out. Rank 0 only:
its traffic is one of W near-symmetric shares (the other ranks are spawned processes, not wrapped).

  python benchmarks/ep_traffic.py                   # tiny, 4 prompts x 32 tokens, ep2 and dp2+ep2
  python benchmarks/ep_traffic.py --model debug --tokens 16
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from openk3.llm import LLM
from openk3.parallel.group import ParallelContext
from openk3.planner.comm import combine_bytes_per_copy, copies_per_token, dispatch_bytes_per_copy
from openk3.planner.inputs import Quantisation
from openk3.serve.sampling import SamplingParams

PROMPTS = [
    "And God said, Let there be light",
    "In the beginning was the Word",
    "The quick brown fox jumps over",
    "Once upon a time, in a land far away,",
] + [f"Prompt number {i}: the story of" for i in range(4, 16)]
LAYOUTS: dict[str, dict[str, Any]] = {"ep2": {"ep": 2}, "dp2+ep2": {"dp": 2, "ep": 2}, "tp2+ep2": {"tp": 2, "ep": 2}}
META_BYTES_PER_ENTRY = 8 + 8 + 4  # the static exchange's row index and compute group (int64) and weight (fp32)


@dataclass
class Traffic:
    """Rank 0's sends over the run, to ranks other than itself."""

    layer_calls: int = 0
    tokens: int = 0  # dispatched by rank 0, summed over MoE layer calls
    entries: int = 0
    remote_copies: int = 0
    remote_entries: int = 0
    dispatch_bytes: int = 0
    combine_bytes: int = 0


traffic = Traffic()
TOP_K = 0  # set from the model's config before the runs


def _remote(counts: Sequence[int], rank: int) -> int:
    return sum(counts) - counts[rank]


def recording(original: Any) -> Any:
    def all_to_all(self: ParallelContext, send_N: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]) -> torch.Tensor:
        me, row_bytes = self.rank, send_N[0].numel() * send_N.element_size() if send_N.shape[0] else 0
        if send_N.dtype == torch.int64 and list(send_counts) == [1] * self.world_size:  # the counts: [W, 2 + G]
            rows, entries = send_N[:, 0].tolist(), send_N[:, 1].tolist()
            traffic.layer_calls += 1
            traffic.entries += sum(entries)
            traffic.tokens += sum(entries) // TOP_K
            traffic.remote_copies += _remote(rows, me)
            traffic.remote_entries += _remote(entries, me)
        elif send_N.dtype == torch.uint8:  # the dispatch payload, counts in bytes
            traffic.dispatch_bytes += _remote(send_counts, me)
        else:  # the combine: result rows back to their sources
            traffic.combine_bytes += _remote(send_counts, me) * row_bytes
        return original(self, send_N, send_counts, recv_counts)

    return all_to_all


def main() -> int:
    global TOP_K
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompts", type=int, default=4, help=f"how many prompts (at most {len(PROMPTS)})")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    parser.add_argument("--layouts", nargs="+", default=["ep2", "dp2+ep2"], choices=list(LAYOUTS))
    args = parser.parse_args()
    if not 1 <= args.prompts <= len(PROMPTS):
        parser.error(f"--prompts {args.prompts}: expected 1..{len(PROMPTS)}")
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")  # a preset without a checkpoint warns about its random weights
    ParallelContext.all_to_all = recording(ParallelContext.all_to_all)  # type: ignore[method-assign]
    prompts, params = PROMPTS[: args.prompts], SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    print("command: python " + " ".join(sys.argv))
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, commit {commit}")
    print(f"model {args.model} (float32), {args.prompts} prompts x {args.tokens} greedy tokens, ep_method ep (exact exchange)\n")

    with LLM(args.model) as llm:
        want = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        config = llm.engine.model_config
    TOP_K = config.moe.num_experts_per_token
    quant = Quantisation(dispatch_bits=32, combine_bits=32)  # the run's activations are fp32, dispatched as they are
    d_b, c_b = dispatch_bytes_per_copy(config, quant), combine_bytes_per_copy(config, quant)

    header = (
        "| layout | MoE layer calls | tokens dispatched | remote copies / token: measured | planner (uniform) | "
        "dispatch B / token / layer: measured | planner (rows only) | measured rows only | combine B / token / layer: measured | planner | check |"
    )
    rows = []
    for name in args.layouts:
        layout = LAYOUTS[name]
        world = layout["ep"]
        global traffic
        traffic = Traffic()
        with LLM(args.model, ep_method="ep", **layout) as llm:
            got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
        t = traffic
        remote_planned, _ = copies_per_token(config, world, dedup=True)
        per_token = max(t.tokens, 1)
        rows_only = (t.dispatch_bytes - t.remote_entries * META_BYTES_PER_ENTRY) / per_token
        rows.append(
            f"| {name} | {t.layer_calls} | {t.tokens} | {t.remote_copies / per_token:.3f} | {remote_planned:.3f} | "
            f"{t.dispatch_bytes / per_token:,.0f} | {remote_planned * d_b:,.0f} | {rows_only:,.0f} | {t.combine_bytes / per_token:,.0f} | "
            f"{remote_planned * c_b:,.0f} | {'tokens equal' if got == want else 'MISMATCH'} |"
        )
    e, k = config.moe.num_experts, TOP_K
    print(
        f"experts {e}, top_k {k}, a2a width {config.moe.latent_size or config.hidden_size} values: {d_b:,.0f} B per dispatched copy, {c_b:,.0f} B per result\n"
    )
    print(header)
    print("|" + "---|" * 11)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

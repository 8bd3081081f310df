"""Per-layer, per-step expert-parallel metrics, returned by the EP backends (drain_stats) rather than logged.

Legend: R ranks, E logical experts. An entry is one (token, expert) pair, i.e. one token slot of an expert GEMM; a row is one
de-duplicated token copy sent to one rank. Collecting them costs one all-gather of E + 2 integers and one host read per
layer (`collect_stats=False` turns them off).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class EPStats(NamedTuple):
    layer_index: int
    method: str  # "ep" | "eplb" | "moonep"
    recv_entries_R: tuple[int, ...]  # entries each rank computed
    recv_rows_R: tuple[int, ...]  # de-duplicated rows each rank received
    rank_max_over_mean: float  # max / mean of recv_entries_R (1.0 when no entries at all)
    maxvio: float  # max_e(T_e / mean_e T_e) - 1 over logical experts, all ranks' tokens
    bytes_sent: int  # this rank: dispatch rows + routing metadata + combine rows
    prefetch_bytes: int  # this rank: expert weights sent to other ranks' prefetch slots
    spilled: int  # MoonEP entries that went back home for lack of a prefetch slot (0 for the other methods)
    comm_s: float  # this rank's wall time in the dispatch and combine collectives
    plan_s: float  # MoonEP: count all-gather + plan + weight prefetch (0.0 for the static methods)
    # This rank's collectives and deliberate host reads for the layer (comm.Tally), the stats' own all-gather and host
    # read excluded: exact EP 3 and 1, fixed capacity 2 and 0, MoonEP 5 and 2 (count all-gather, prefetch; the plan's
    # split sizes and the exchange's counts).
    collectives: int = 0
    host_reads: int = 0
    dropped: int = 0  # fixed-capacity mode: this rank's entries beyond an expert's capacity, computed as zero


def max_over_mean(load: torch.Tensor) -> float:
    mean = float(load.double().mean()) if load.numel() else 0.0
    return float(load.max()) / mean if mean > 0 else 1.0


def maxvio(tokens_per_expert_E: torch.Tensor) -> float:
    return max_over_mean(tokens_per_expert_E) - 1.0

"""Engine flags shared by `openk3 serve` and `openk3 generate`: prefix caching and its tiers (docs/serving.md)."""

from __future__ import annotations

import argparse


def add_prefix_cache_arguments(p: argparse.ArgumentParser) -> None:
    """Prefix caching and its tiers (docs/serving.md, "Prefix caching and tiers"); shared with `openk3 serve`."""
    p.add_argument("--enable-prefix-caching", action="store_true", help="reuse cached prefixes (MLA pages + KDA state snapshots)")
    p.add_argument("--prefix-match-unit", type=int, default=64, help="tokens; prefill chunks are cut and states snapshotted at its multiples")
    p.add_argument("--cpu-offload-gb", type=float, default=0.0, help="host-DRAM tier for evicted prefixes (GiB; 0: none)")
    p.add_argument("--disk-offload-dir", default=None, help="directory of the disk tier (a private subfolder is made and removed)")
    p.add_argument("--disk-offload-gb", type=float, default=0.0, help="disk tier budget (GiB; needs --disk-offload-dir)")


def prefix_cache_options(args: argparse.Namespace) -> dict:
    """EngineConfig fields from the prefix-cache flags."""
    return {
        "enable_prefix_caching": args.enable_prefix_caching,
        "prefix_match_unit": args.prefix_match_unit,
        "cpu_offload_bytes": int(args.cpu_offload_gb * 2**30),
        "disk_offload_dir": args.disk_offload_dir,
        "disk_offload_bytes": int(args.disk_offload_gb * 2**30),
    }


def add_process_arguments(p: argparse.ArgumentParser) -> None:
    """Process-wide settings of a serving process (not of an engine): the C heap (serve/cpu_heap.py)."""
    from openk3.serve.cpu_heap import HEAP_MODES, default_heap_mode

    p.add_argument(
        "--cpu-heap",
        choices=HEAP_MODES,
        default=default_heap_mode(),
        help="keep: freed heap memory stays in the process for the next step's temporaries (faster CPU steps, RSS stays at its "
        "high-water mark); system: the C library's defaults (default: $OPENK3_CPU_HEAP, else keep)",
    )

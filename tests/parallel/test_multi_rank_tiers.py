"""Host and disk prefix tiers on multi-rank engines. Ranks holding replicas of rank 0's pools (`--cp N`, `--ep N` with
tp = 1): a tier load into rank 0's pools goes to the workers with its buffer (serving/driver.py, step_channel LOAD).
Ranks holding shards (`--tp N`: of the heads; `--cp N --dcp`: of the MLA pages): each keeps its own shard of rank 0's host
tier (serve/cache/tier_mirror.py), packed, spilled to files of its own, loaded and dropped as rank 0's prefix cache logs it
(step_channel MIRROR). Either way prompts that hit prefixes evicted to the tier give one process's tokens, its hit counts
and its logprobs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from openk3.llm import LLM
from openk3.parallel.config import ParallelConfig
from openk3.serve.cache.tier_types import TierKind
from openk3.serve.config import EngineConfig
from tests.parallel.test_llm_cp_prefix import ENGINE, sends

# one snapshot slot: every prompt's snapshots push the previous prompt's out to the tier, so the repeats load from it
TIGHT = dict(enable_prefix_caching=True, num_snapshot_slots=1, **ENGINE)


def tiers(tmp_path: Path, kind: TierKind) -> dict[str, Any]:
    return dict(cpu_offload_bytes=64 << 20) if kind == TierKind.HOST else dict(disk_offload_dir=str(tmp_path), disk_offload_bytes=256 << 20)


def rounds(llm: LLM, kind: TierKind) -> dict[str, Any]:
    """test_llm_cp_prefix's sends (the repeats now find their snapshots in the tier), and what the tests compare."""
    try:
        outs = sends(llm)
        stats = llm.engine.stats().prefix_cache
        assert stats is not None
        tier = stats.tier(kind)
        assert tier is not None
        return {
            "tokens": [list(o.token_ids) for o in outs],
            "logprobs": [lp.logprob for o in outs for lp in o.logprobs or ()],
            "hits": stats.hit_tokens,
            "tier_hits": tier.hits,
        }
    finally:
        llm.close()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[TierKind, dict[str, Any]]:
    torch.set_num_threads(1)
    return {kind: rounds(LLM("tiny", **TIGHT, **tiers(tmp_path_factory.mktemp(kind.value), kind)), kind) for kind in (TierKind.HOST, TierKind.DISK)}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("layout", "kind"),
    [
        (dict(cp=2, cp_min_tokens=32), TierKind.HOST),
        (dict(cp=2, cp_min_tokens=32), TierKind.DISK),
        (dict(ep=2), TierKind.HOST),
        (dict(tp=2), TierKind.HOST),
        (dict(tp=2, ep=2), TierKind.HOST),
        (dict(tp=2), TierKind.DISK),
        (dict(cp=2, decode_cp=True, cp_min_tokens=32), TierKind.HOST),
        (dict(cp=2, decode_cp=True, cp_min_tokens=32), TierKind.DISK),
    ],
)
def test_tier_hits_on_multi_rank_engines_give_one_process_results(one_process, tmp_path: Path, layout: dict[str, Any], kind: TierKind) -> None:
    torch.set_num_threads(1)
    want = one_process[kind]
    assert want["tier_hits"] > 0, "the one-process oracle loads from the tier"
    got = rounds(LLM("tiny", **layout, **TIGHT, **tiers(tmp_path, kind)), kind)
    assert list(tmp_path.iterdir()) == [], "every rank removed its disk tier folder on close"
    assert got["tier_hits"] == want["tier_hits"] and got["hits"] == want["hits"]
    assert got["tokens"] == want["tokens"]
    assert got["logprobs"] == pytest.approx(want["logprobs"], abs=1e-4)


def test_every_layout_takes_both_tiers() -> None:
    host = EngineConfig(enable_prefix_caching=True, cpu_offload_bytes=1 << 20)
    disk = EngineConfig(enable_prefix_caching=True, disk_offload_dir="/tmp/openk3-never-made")
    layouts = (ParallelConfig(cp=2), ParallelConfig(ep=2), ParallelConfig(cp=2, ep=2), ParallelConfig(tp=2), ParallelConfig(cp=2, tp=2))
    for layout in (*layouts, ParallelConfig(dp=2, tp=2, ep=4), ParallelConfig(cp=2, decode_cp=True)):
        layout.check_engine(host)
        layout.check_engine(disk)

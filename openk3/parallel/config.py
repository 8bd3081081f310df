"""ParallelConfig: how many ranks a model is spread over and how, declared once for `LLM(**overrides)` and `openk3 serve`
(flags built from the declarations, openk3/options.py), and the checks that concern an engine's settings together with it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from openk3.options import check_settings, setting
from openk3.serve.config import EngineConfig


class EPMethod(str, enum.Enum):
    EP = "ep"  # contiguous experts, no balancing
    EPLB = "eplb"  # static placement with replicas (needs placements)
    MOONEP = "moonep"  # per-step balanced plan with expert prefetch


EP_METHODS = tuple(m.value for m in EPMethod)


@dataclass(frozen=True)
class ParallelConfig:
    tp: int = setting(1, "tensor-parallel ranks: attention heads, MLPs, shared experts and vocabulary split over them (docs/parallel.md)", low=1)
    ep: int = setting(1, "expert-parallel ranks (LLM spawns them; openk3 serve runs one per torchrun process; docs/parallel.md)", low=1)
    dp: int = setting(
        1, "data-parallel attention groups (of --tp ranks each): each runs an engine (scheduler, cache, prefix cache) of its own; needs ep = dp x tp", low=1
    )
    ep_method: str = setting(EPMethod.MOONEP.value, "how experts and tokens are spread over the ranks (docs/parallel.md)", choices=EP_METHODS)
    ep_threads: int = setting(1, "torch threads of each worker rank LLM spawns", low=1, cli=False)
    ep_timeout_s: float = setting(
        300.0, "seconds one collective of the expert-parallel group may wait for a rank before the step fails (a stalled or dead rank)", low=1
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.dp > 1 and self.ep != self.dp * self.tp:
            raise ValueError(
                f"ParallelConfig: dp={self.dp} with tp={self.tp}, ep={self.ep}: data-parallel attention spreads the experts over all "
                f"dp x tp = {self.dp * self.tp} ranks (ep={self.dp * self.tp}): the MoE layers are what the DP groups share (docs/parallel.md)"
            )
        if self.tp > 1 and self.ep > 1 and self.ep != self.tp and self.dp == 1:
            raise ValueError(
                f"ParallelConfig: tp={self.tp} with ep={self.ep}: one engine runs its experts over its TP group (ep=1 or ep={self.tp}); "
                "ep = dp x tp spreads them over dp data-parallel groups of tp ranks (--dp, docs/parallel.md)"
            )

    @property
    def world_size(self) -> int:
        """Processes one engine runs on: dp groups of tp ranks, or the TP group, whose ranks also hold the experts when ep > 1."""
        return self.dp * self.tp if self.dp > 1 else max(self.tp, self.ep)

    def check_engine(self, engine: EngineConfig) -> None:
        """Refuse, on every rank alike and before any rank joins a group, what expert-parallel serving cannot do."""
        ranks = f"ep={self.ep}" if self.tp == 1 else f"tp={self.tp}, ep={self.ep}"
        tiers = engine.enable_prefix_caching and (engine.cpu_offload_bytes or engine.disk_offload_dir is not None)
        if self.world_size > 1 and (self.dp == 1 or self.tp > 1) and tiers:
            # a tier buffer holds rank 0's pools only (a TP rank's KDA heads are its own); device prefix caching is fine:
            # the driver replays rank 0's slot and page copies on every rank (serving/driver.py)
            raise ValueError(
                f"cpu_offload_bytes / disk_offload_dir with {ranks}: the host and disk prefix tiers are not supported on more than one rank yet "
                "(docs/parallel.md)"
            )
        if self.world_size > 1 and engine.device.startswith("cuda:"):
            # each rank takes the GPU of its local rank; an explicit index would put every rank on that one device
            raise ValueError(f"device={engine.device!r} with {ranks}: rank r takes GPU r, so name no index (device='cuda')")

"""Measured expert load on disk: what an engine exports (`--export-eplb-stats FILE`) and `--ep-method eplb` places from.

Legend: E logical experts of every MoE layer, L the MoE layers, R ranks.

EPLB balances only as well as its load estimate: a placement from a uniform load replicates experts 0..n-1 and balances
nothing. So an EPLB engine needs a file of measured load, and refuses to start without one rather than pretend.

File (JSON, small: L x E integers):
  {"format": "openk3-expert-load", "version": 1, "num_experts": E, "window_steps": n,
   "layers": {"<layer index>": [tokens routed to expert 0, ..., expert E-1], ...}}
window_steps: model calls the counts cover (the LoadCollector window, or fewer when the run was shorter; for an exported
file every step the engine ran). Counts are routing entries (token, expert) summed over the window, over every rank's tokens.

Export: an engine started with --export-eplb-stats counts from outside the model (`record_expert_load`: RecordingExperts
around each MoE layer's backend, a running sum) and writes the file when it closes (LLM.close(), the server's shutdown).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from openk3.model.model import K3ForCausalLM
from openk3.model.moe import ExpertBackend, LatentMoE
from openk3.ops.moe.router import RouterOutput
from openk3.parallel.config import STATS_NEEDED
from openk3.parallel.ep.placement import LoadCollector, Placement, eplb_placement, redundant_for
from openk3.parallel.group import ParallelContext

FORMAT = "openk3-expert-load"
log = logging.getLogger("openk3.parallel.ep")
VERSION = 1


class LoadStatsError(ValueError):
    """A load file that cannot be used: names the file and what is wrong."""


@dataclass(frozen=True)
class ExpertLoad:
    num_experts: int
    window_steps: int
    layers: Mapping[int, torch.Tensor]  # layer index -> [E] int64 entries per expert

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise LoadStatsError(f"expert load: num_experts={self.num_experts}, expected >= 1")
        if self.window_steps < 0:
            raise LoadStatsError(f"expert load: window_steps={self.window_steps}, expected >= 0")
        for layer, counts in self.layers.items():
            if tuple(counts.shape) != (self.num_experts,):
                raise LoadStatsError(f"expert load: layer {layer} has {tuple(counts.shape)} counts, expected ({self.num_experts},)")
            if bool((counts < 0).any()):
                raise LoadStatsError(f"expert load: layer {layer} has negative counts")

    @classmethod
    def from_collector(cls, collector: LoadCollector) -> ExpertLoad:
        layers = collector.layers()
        return cls(collector.num_experts, max((collector.steps(i) for i in layers), default=0), {i: collector.load(i) for i in layers})

    def save(self, path: str | Path) -> None:
        body = {
            "format": FORMAT,
            "version": VERSION,
            "num_experts": self.num_experts,
            "window_steps": self.window_steps,
            "layers": {str(i): self.layers[i].tolist() for i in sorted(self.layers)},
        }
        Path(path).write_text(json.dumps(body) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ExpertLoad:
        try:
            body = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise LoadStatsError(f"expert load file {path}: cannot read it as JSON ({e})") from e
        if not isinstance(body, dict) or body.get("format") != FORMAT or body.get("version") != VERSION:
            raise LoadStatsError(f"expert load file {path}: expected format {FORMAT!r} version {VERSION}")
        missing = [key for key in ("num_experts", "window_steps", "layers") if key not in body]
        if missing or not isinstance(body["layers"], dict):
            raise LoadStatsError(f"expert load file {path}: needs 'num_experts', 'window_steps' and a 'layers' object (missing {missing})")
        layers = {}
        for key, counts in body["layers"].items():
            if not key.isdigit() or not isinstance(counts, list) or not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
                raise LoadStatsError(f"expert load file {path}: layer {key!r} must map a layer index to a list of integer counts")
            layers[int(key)] = torch.tensor(counts, dtype=torch.int64)
        try:
            return cls(int(body["num_experts"]), int(body["window_steps"]), layers)
        except (TypeError, ValueError) as e:
            raise LoadStatsError(f"expert load file {path}: {e}") from e

    def check_model(self, layers: Iterable[int], num_experts: int, source: str = "expert load") -> None:
        """The file must describe this model: same expert count, every MoE layer present, some tokens counted."""
        wanted = sorted(layers)
        if self.num_experts != num_experts:
            raise LoadStatsError(f"{source}: num_experts={self.num_experts}, the model has {num_experts} experts per MoE layer")
        missing = [i for i in wanted if i not in self.layers]
        if missing:
            raise LoadStatsError(f"{source}: no counts for MoE layers {missing} (has {sorted(self.layers)})")
        empty = [i for i in wanted if int(self.layers[i].sum()) == 0]
        if empty:
            raise LoadStatsError(f"{source}: MoE layers {empty} counted no tokens; measure a run that serves requests")


def gather_load(ctx: ParallelContext, collector: LoadCollector) -> ExpertLoad:
    """Every rank's collected load summed over ranks (attention data-parallel: each rank saw only its tokens); all ranks call."""
    mine = ExpertLoad.from_collector(collector)
    layers = sorted(mine.layers)
    counts = torch.stack([mine.layers[i] for i in layers]) if layers else torch.zeros(0, collector.num_experts, dtype=torch.int64)
    summed = ctx.all_gather(counts.to(ctx.device)).cpu().sum(0)
    return ExpertLoad(collector.num_experts, mine.window_steps, {i: summed[n] for n, i in enumerate(layers)})


def placements_from_load(load: ExpertLoad, layers: Iterable[int], num_ranks: int, num_redundant: int) -> dict[int, Placement]:
    return {i: eplb_placement(load.layers[i], num_ranks, num_redundant) for i in layers}


def eplb_engine_placements(
    layers: Iterable[int], num_experts: int, num_ranks: int, stats_path: str | Path | None, redundant_fraction: float
) -> dict[int, Placement]:
    """What `--ep-method eplb --eplb-stats FILE` places: replicas of the measured heaviest experts, packed evenly."""
    if stats_path is None:
        raise ValueError(STATS_NEEDED)
    wanted = list(layers)
    load = ExpertLoad.load(stats_path)
    load.check_model(wanted, num_experts, source=f"expert load file {stats_path}")
    return placements_from_load(load, wanted, num_ranks, redundant_for(num_experts, num_ranks, redundant_fraction))


class RecordingExperts:
    """An ExpertBackend that counts each layer's routing into a LoadCollector, then runs `inner` (any backend): how a
    single-process engine, or one that feeds every rank the same batch, measures the load an EPLB placement needs."""

    def __init__(self, inner: ExpertBackend, collector: LoadCollector) -> None:
        self.inner, self.collector = inner, collector

    def __call__(self, layer: LatentMoE, z_TD: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        self.collector.observe(layer.layer_index, routing.topk_idx)
        return self.inner(layer, z_TD, routing)


class LoadRecording:
    """What `record_expert_load` attached to a model: the running counts, `save` to write them to `path`, and `detach` to
    give the layers their backends back."""

    def __init__(self, model: K3ForCausalLM, path: Path, collector: LoadCollector, previous: list[ExpertBackend]) -> None:
        self.model, self.path, self.collector, self._previous = model, path, collector, previous
        self.layers = [moe.layer_index for moe in model.moe_layers()]

    def steps(self) -> int:
        """Model calls counted (the most any MoE layer saw)."""
        return max((self.collector.steps(i) for i in self.layers), default=0)

    def load(self) -> ExpertLoad:
        """The counts so far, every MoE layer of the model listed (a layer never called: zeros, which --eplb-stats refuses)."""
        return ExpertLoad(self.collector.num_experts, self.steps(), {i: self.collector.load(i) for i in self.layers})

    def save(self) -> ExpertLoad:
        """Write the counts to `path` (and log it); raises OSError when it cannot be written."""
        load = self.load()
        load.save(self.path)
        log.info("wrote the expert load of %d steps to %s (--eplb-stats reads it)", load.window_steps, self.path)
        return load

    def detach(self) -> None:
        """Each MoE layer gets back the backend it had before recording (idempotent)."""
        for moe, previous in zip(self.model.moe_layers(), self._previous, strict=True):
            if isinstance(moe.backend, RecordingExperts) and moe.backend.collector is self.collector:
                moe.backend = previous


def record_expert_load(model: object, path: str | Path) -> LoadRecording:
    """Count, from now on, every routing entry of every MoE layer of `model` (a running sum: one [E] tensor per layer),
    by wrapping each layer's current expert backend in RecordingExperts; `save()` writes them to `path` (its folder must
    exist now, so a typo fails at start-up rather than after serving).

    What the counts cover is what this model's router sees: everything in one process, and the whole batch on rank 0 of a
    replicated-attention layout (--ep N or --tp N; its EP backend is a TokenSplit, which splits the batch only after the
    wrapper counted it). With data-parallel attention a rank routes only its own tokens: gather over the ranks instead
    (gather_load). Attach after the model is prepared for serving: prepare_for_serving re-selects the ops of a bare
    LocalExperts it finds, not of one wrapped here."""
    target = Path(path)
    if not target.parent.is_dir():
        raise LoadStatsError(f"export_eplb_stats={str(path)!r}: the folder {str(target.parent)!r} does not exist")
    if not isinstance(model, K3ForCausalLM):
        raise ValueError(f"export_eplb_stats: counts the MoE layers of a K3ForCausalLM, got {type(model).__name__}")
    collector = LoadCollector(model.config.moe.num_experts, window=None)
    previous = []
    for moe in model.moe_layers():
        previous.append(moe.backend)
        moe.backend = RecordingExperts(moe.backend, collector)
    return LoadRecording(model, target, collector, previous)

"""EngineSpec: everything an engine is built from -- where its model comes from, how it is laid out over ranks, and the
engine's own settings -- so that `LLM`, the server, every rank and every Ray replica describe an engine the same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from openk3.parallel.config import ParallelConfig
from openk3.parallel.serving.ranks import RankModelSpec
from openk3.serve.config import EngineConfig
from openk3.serve.tokenizer import Tokenizer

ModelSource = str | Path | torch.nn.Module


@dataclass(frozen=True)
class EngineSpec:
    """`model`: a preset name, a checkpoint folder (serve/loading.py), or a built module (it then keeps its owner's weights:
    a multi-rank layout cuts a copy). `tokenizer`: the caller's own, else the checkpoint's (with `byte_tokenizer` the byte
    tokenizer with the checkpoint's bos/eos ids), or for a module the byte tokenizer over its vocabulary."""

    model: ModelSource
    engine: EngineConfig = field(default_factory=EngineConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    tokenizer: Tokenizer | None = None
    byte_tokenizer: bool = False

    @property
    def owns_model(self) -> bool:
        """Whether the engine loads its model itself (nothing else writes to it), rather than being handed a module."""
        return not isinstance(self.model, torch.nn.Module)

    def rank_spec(self, collect_stats: bool) -> RankModelSpec:
        """What every rank of a multi-rank layout builds its part of the model from (the same on every rank)."""
        e = self.engine
        return RankModelSpec.of(self.model, self.parallel, e.torch_dtype, e.seed, collect_stats, ops=e.ops, disk_dir=e.disk_offload_dir)

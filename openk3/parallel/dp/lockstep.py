"""LockstepModel: a DP group's model as its engine sees it, guaranteeing one forward per global step.

Every MoE layer is a collective over all ranks, so every DP group must run exactly one forward per step, in step with
the others, whether or not its engine had anything to run. The engine calls this object as its model; after the
engine's step, `end_step()` runs a one-token dummy forward without cache pools when the engine ran none (its output is
discarded, nothing is written anywhere), and refuses a step in which the engine ran more than one. With tensor
parallelism inside the group the model is the group's EPDriver, so its TP ranks run the dummy too; `close()` then
releases them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from openk3.config import ModelConfig
from openk3.model.batch import CacheTensors, ForwardBatch
from openk3.parallel.serving.driver import EPDriver, ForwardModel


class LockstepModel:
    def __init__(self, model: ForwardModel, device: torch.device) -> None:
        self.model, self.device = model, device
        self.config: ModelConfig = model.config
        self.forwards = 0
        self.dummy_forwards = 0

    def __call__(self, batch: ForwardBatch, cache: CacheTensors) -> torch.Tensor:
        self.forwards += 1
        return self.model(batch, cache)

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        return self.model.parameters(recurse)

    def end_step(self) -> None:
        ran, self.forwards = self.forwards, 0
        if ran > 1:
            raise RuntimeError(f"LockstepModel: the engine ran {ran} forwards in one step; DP ranks must run exactly one each")
        if ran == 0:
            self.dummy_forwards += 1
            with torch.inference_mode():
                self.model(ForwardBatch.from_tokens(torch.zeros(1, 1, dtype=torch.int64, device=self.device)), None)

    @property
    def failed(self) -> bool:
        return isinstance(self.model, EPDriver) and self.model.failed

    def close(self) -> None:
        """Release the group's TP ranks (idempotent; nothing without tensor parallelism)."""
        if isinstance(self.model, EPDriver):
            self.model.close()

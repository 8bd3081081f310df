"""Off-policy distillation: the student learns the teachers' next-token distributions on a corpus they scored once.

Legend: B windows per batch, L positions per window, k the store's top-k, V the student's vocabulary.

The teachers' top-k (train/teacher_store.py, written by train/teachers.py through the engine) is streamed in batches; each
step's loss is `kl_weight * KL + (1 - kl_weight) * cross-entropy` (train/distill_loss.py), the KL in the configured direction
and top-k form, averaged over every scored position. Everything else is the plain trainer's: AdamW with warmup and cosine,
clipping, router balancing, MXFP4 QAT at the end, checkpoints that resume bit for bit (the stream's position included).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from openk3.checks import check_int, check_number
from openk3.config import ModelConfig
from openk3.train.distill_loss import Direction, TopK, mixed_loss, topk_kl
from openk3.train.teacher_store import TeacherStream
from openk3.train.trainer import TrainConfig, Trainer


@dataclass(frozen=True)
class DistillConfig:
    direction: Direction = Direction.FORWARD
    approx: TopK = TopK.TAIL
    kl_weight: float = 1.0  # 1: the KL alone; 0: the plain next-token loss (the teachers' scores unused)

    def __post_init__(self) -> None:
        check_number("DistillConfig", "kl_weight", self.kl_weight, low=0.0, high=1.0)


def distill_losses(
    logits_BLV: torch.Tensor, tokens_BL1: torch.Tensor, topk_ids_BLk: torch.Tensor, topk_logprobs_BLk: torch.Tensor, cfg: DistillConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, mean KL, mean cross-entropy) of a batch of scored windows."""
    V = logits_BLV.shape[-1]
    k = topk_ids_BLk.shape[-1]
    flat = logits_BLV.float().reshape(-1, V)
    ce = F.cross_entropy(flat, tokens_BL1[:, 1:].reshape(-1), reduction="none")
    kl = topk_kl(flat, topk_ids_BLk.reshape(-1, k), topk_logprobs_BLk.reshape(-1, k), cfg.direction, cfg.approx)
    return mixed_loss(kl, ce, cfg.kl_weight), kl.detach().mean(), ce.detach().mean()


class DistillTrainer(Trainer):
    """The plain trainer whose batches are scored windows and whose loss is the distillation mix (module docstring)."""

    def __init__(
        self, model_config: ModelConfig, cfg: TrainConfig, distill: DistillConfig, stream: TeacherStream, held_out_WL1: torch.Tensor, out: Path | None
    ) -> None:
        layout = stream.layout
        if layout.seq_len != cfg.seq_len:
            raise ValueError(f"the teacher store holds windows of {layout.seq_len} positions, TrainConfig.seq_len={cfg.seq_len}")
        check_int("DistillTrainer", "store k", layout.k, low=1)
        super().__init__(model_config, cfg, stream, held_out_WL1, out)
        self.distill = distill

    def batch_loss(self) -> tuple[torch.Tensor, dict]:
        stream = self.data
        assert isinstance(stream, TeacherStream), "a distillation trainer reads a teacher store"
        batch = stream.next_batch(self.cfg.batch_size)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.bf16_autocast):
            logits = self.model.forward_tokens(batch.tokens_WL1[:, :-1])
        loss, kl, ce = distill_losses(logits, batch.tokens_WL1, batch.topk_ids_WLk, batch.topk_logprobs_WLk, self.distill)
        return loss, {"kl": float(kl), "ce": float(ce)}

"""Single-process CPU trainer for the demo model: AdamW, warmup + cosine, clipping, router balancing, MXFP4 QAT at the end.

Legend: B windows per batch, L window length, T = B * L tokens per step, E experts, k experts per token.

Every step: forward through a recording expert backend (it hands each MoE layer's router scores and choices to the balancer,
then runs the experts: dense, or fake-quantised MXFP4 once the QAT phase starts), next-token cross-entropy, backward,
clip, AdamW, schedule, then the balancer moves each layer's selection bias. A checkpoint holds everything a resumed run
needs to continue bit for bit: model, optimizer, schedule, data position, RNG states, the step log.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from openk3.checks import check_int, check_number
from openk3.config import ModelConfig
from openk3.model import K3ForCausalLM
from openk3.model.moe import DenseExperts, ExpertBackend, LatentMoE, LocalExperts
from openk3.ops.moe.router import RouterOutput
from openk3.ops.registry import OpTarget, op
from openk3.train.balance import BalanceConfig, RouterBalancer
from openk3.train.data import TokenWindows
from openk3.train.qat import FakeQuantExpertBank

NO_DECAY = ("norm", "A_log", "dt_bias", "_res_proj", "e_score_correction_bias")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 100
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    qat_fraction: float = 0.0  # the last fraction of steps run the routed experts through MXFP4 fake quantisation
    eval_every: int = 50
    eval_windows: int = 16
    checkpoint_every: int = 25
    bf16_autocast: bool = False
    balance: BalanceConfig = field(default_factory=BalanceConfig)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "eval_every", "checkpoint_every"):
            check_int("TrainConfig", name, getattr(self, name), low=1)
        check_number("TrainConfig", "qat_fraction", self.qat_fraction, low=0.0, high=1.0)
        check_int("TrainConfig", "warmup_steps", self.warmup_steps, low=0)

    @property
    def qat_start(self) -> int:
        return self.steps - round(self.steps * self.qat_fraction)


class DataSource(Protocol):
    """Where a trainer's batches come from (TokenWindows here; a distillation trainer's scored windows or prompts): its
    position is part of the checkpoint."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


TRAINING = OpTarget(training=True)  # what the trainer's implementations are resolved for


class FakeQuantExperts:
    """Expert backend for QAT: the layer's master weights through MXFP4 fake quantisation (straight-through gradient)."""

    def __init__(self, impl: str = "auto", target: OpTarget = TRAINING) -> None:
        self.op = op("moe_experts", impl, target)

    def __call__(self, layer: LatentMoE, z_TD: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        ex = layer.experts
        assert isinstance(ex, DenseExperts), "QAT fake-quantises the dense master experts; a packed MXFP4 bank has none"
        bank = FakeQuantExpertBank(ex.w1, ex.w3, ex.w2)
        return self.op(z_TD, routing.topk_idx, routing.topk_weight, bank, layer.expert_act)


class RecordingExperts:
    """Expert backend that reports each layer's routing to the balancer (when one is attached), then delegates."""

    def __init__(self, inner: ExpertBackend, balancer: RouterBalancer | None) -> None:
        self.inner, self.balancer = inner, balancer

    def __call__(self, layer: LatentMoE, z_TD: torch.Tensor, routing: RouterOutput) -> torch.Tensor:
        if self.balancer is not None and torch.is_grad_enabled():  # evaluation (no_grad) must not move the bias
            self.balancer.observe(layer.layer_index, routing.scores, routing.topk_idx)
        return self.inner(layer, z_TD, routing)


def training_config(config: ModelConfig) -> ModelConfig:
    """Training keeps fp32 master experts; MXFP4 is applied by QAT and at export."""
    return dataclasses.replace(config, expert_quantization=None)


def lr_factor(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to 1, then cosine down to min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        (no_decay if any(s in name for s in NO_DECAY) or p.dim() < 2 else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def lm_loss(model: K3ForCausalLM, batch_BL1: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    inputs, targets = batch_BL1[:, :-1], batch_BL1[:, 1:]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model.forward_tokens(inputs)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def evaluate(model: K3ForCausalLM, windows_WL1: torch.Tensor, batch_size: int = 8, bf16: bool = False) -> float:
    """Mean next-token loss over the windows (every window has the same length, so a plain mean of batch means)."""
    total, count = 0.0, 0
    for i in range(0, windows_WL1.shape[0], batch_size):
        chunk = windows_WL1[i : i + batch_size]
        total += float(lm_loss(model, chunk, bf16)) * chunk.shape[0]
        count += chunk.shape[0]
    return total / count


class Trainer:
    def __init__(self, model_config: ModelConfig, cfg: TrainConfig, train: DataSource, held_out_WL1: torch.Tensor, out: Path | None) -> None:
        self.cfg, self.data, self.held_out, self.out = cfg, train, held_out_WL1, out
        torch.manual_seed(cfg.seed)
        self.model = K3ForCausalLM(training_config(model_config))
        self.model.init_weights(cfg.seed)
        self.model.select_ops(target=TRAINING)  # "auto" is then the differentiable chunkwise KDA, F.linear, torch's norm
        self.model.train()
        self.optimizer = make_optimizer(self.model, cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, cfg))
        self.balancer = RouterBalancer(cfg.balance, model_config.moe.num_experts_per_token)
        self.step = 0
        self.log: list[dict] = []
        self._set_backend()

    def _set_backend(self) -> None:
        inner = FakeQuantExperts() if self.qat_active else LocalExperts(target=TRAINING)
        self.model.set_expert_backend(RecordingExperts(inner, self.balancer))

    @property
    def qat_active(self) -> bool:
        return self.cfg.qat_fraction > 0 and self.step >= self.cfg.qat_start

    def batch_loss(self) -> tuple[torch.Tensor, dict]:
        """The loss of the next batch and what the step's log line adds for it; a distillation trainer replaces it."""
        data = self.data
        assert isinstance(data, TokenWindows), "the plain trainer reads token windows"
        return lm_loss(self.model, data.next_batch(self.cfg.batch_size), self.cfg.bf16_autocast), {}

    def after_step(self) -> dict:
        """Runs after the optimizer and the balancer moved the weights (on-policy distillation pushes them to its engine)."""
        return {}

    def train_step(self) -> dict:
        cfg = self.cfg
        backend = self.model.moe_layers()[0].backend
        if self.qat_active and not (isinstance(backend, RecordingExperts) and isinstance(backend.inner, FakeQuantExperts)):
            self._set_backend()
        t0 = time.perf_counter()
        qat = self.qat_active
        loss, extra = self.batch_loss()
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        loads = self.balancer.step(self.model.moe_layers())
        self.step += 1
        extra |= self.after_step()
        rec = extra | {
            "step": self.step,
            "loss": loss.item(),
            "lr": lr,
            "grad_norm": float(grad_norm),
            "tokens": self.step * cfg.batch_size * cfg.seq_len,
            "qat": qat,
            "load_max_over_mean": {str(k): round(v, 4) for k, v in loads.items()},
            "seconds": time.perf_counter() - t0,
        }
        if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
            self.model.eval()
            rec["held_out_loss"] = evaluate(self.model, self.held_out[: cfg.eval_windows], bf16=cfg.bf16_autocast)
            self.model.train()
        self.log.append(rec)
        return rec

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "data": self.data.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "log": self.log,
            "train_config": dataclasses.asdict(self.cfg) | {"balance": repr(self.cfg.balance)},
        }

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.data.load_state_dict(state["data"])
        torch.set_rng_state(state["torch_rng"])
        self.step, self.log = int(state["step"]), list(state["log"])
        self._set_backend()

    def save_checkpoint(self) -> Path:
        assert self.out is not None
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "checkpoint.pt"
        tmp = path.with_suffix(".tmp")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)  # a crash mid-write leaves the previous checkpoint intact
        with open(self.out / "log.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in self.log)
        return path

    def resume(self) -> bool:
        path = None if self.out is None else self.out / "checkpoint.pt"
        if path is None or not path.is_file():
            return False
        self.load_state_dict(torch.load(path, weights_only=False))
        return True

    def fit(self, progress: bool = True) -> list[dict]:
        from tqdm import tqdm

        bar = tqdm(total=self.cfg.steps, initial=self.step, disable=not progress, dynamic_ncols=True)
        while self.step < self.cfg.steps:
            rec = self.train_step()
            worst = max(rec["load_max_over_mean"].values(), default=float("nan"))
            bar.set_postfix(loss=f"{rec['loss']:.3f}", lr=f"{rec['lr']:.1e}", load=f"{worst:.2f}", qat=int(rec["qat"]))
            bar.update(1)
            if self.out is not None and (self.step % self.cfg.checkpoint_every == 0 or self.step == self.cfg.steps):
                self.save_checkpoint()
        bar.close()
        return self.log

"""A short training run on the debug config: the loss falls, a resumed run repeats the uninterrupted one exactly, the QAT
phase stays close to full precision, and the balancer's effect on expert load (QB vs sign vs none, same seed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from openk3.config import debug
from openk3.train.balance import BalanceConfig, BalanceMethod
from openk3.train.data import TokenWindows, eval_windows
from openk3.train.trainer import FakeQuantExperts, RecordingExperts, TrainConfig, Trainer, lr_factor

STEPS = 20


def synthetic_stream(n: int = 6000, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    """A learnable stream: mostly a fixed successor per token, sometimes a random one."""
    g = torch.Generator().manual_seed(seed)
    successor = torch.randperm(vocab, generator=g)
    noise = torch.rand(n, generator=g) < 0.2
    random = torch.randint(0, vocab, (n,), generator=g)
    out = torch.empty(n, dtype=torch.int64)
    out[0] = 0
    for i in range(1, n):
        out[i] = random[i] if noise[i] else successor[out[i - 1]]
    return out


STREAM = synthetic_stream(8000)
TRAIN, HELD_OUT = STREAM[:6000], STREAM[6000:]


def make_trainer(out=None, **overrides) -> Trainer:
    cfg = TrainConfig(steps=STEPS, batch_size=4, seq_len=32, lr=3e-3, warmup_steps=2, eval_every=10, eval_windows=8, checkpoint_every=10)
    cfg = dataclasses.replace(cfg, **overrides)
    return Trainer(debug().replace(vocab_size=64), cfg, TokenWindows(TRAIN, 32, seed=0), eval_windows(HELD_OUT, 32, 8), out)


@pytest.fixture(scope="module")
def baseline() -> list[dict]:
    torch.set_num_threads(1)
    return make_trainer().fit(progress=False)


def test_loss_falls(baseline):
    first, last = baseline[0]["loss"], sum(r["loss"] for r in baseline[-5:]) / 5
    assert last < first - 1.0, (first, last)
    assert baseline[-1]["held_out_loss"] < baseline[9]["held_out_loss"]


def test_resume_repeats_the_uninterrupted_run_exactly(baseline, tmp_path):
    torch.set_num_threads(1)
    first = make_trainer(tmp_path)
    for _ in range(10):
        first.train_step()
    first.save_checkpoint()
    resumed = make_trainer(tmp_path)
    assert resumed.resume() and resumed.step == 10
    log = resumed.fit(progress=False)
    assert [r["loss"] for r in log[10:]] == [r["loss"] for r in baseline[10:]]
    assert log[-1]["held_out_loss"] == baseline[-1]["held_out_loss"]


def test_qat_phase_stays_within_five_percent(baseline):
    torch.set_num_threads(1)
    trainer = make_trainer(qat_fraction=0.5)
    log = trainer.fit(progress=False)
    assert [r["qat"] for r in log] == [False] * 10 + [True] * 10
    assert all(isinstance(m.backend, RecordingExperts) and isinstance(m.backend.inner, FakeQuantExperts) for m in trainer.model.moe_layers())
    assert log[-1]["held_out_loss"] == pytest.approx(baseline[-1]["held_out_loss"], rel=0.05)
    assert log[-1]["held_out_loss"] != baseline[-1]["held_out_loss"]  # the experts really were quantised


@pytest.mark.slow
def test_balance_statistics_qb_sign_none(baseline):
    """Same seed, same data: mean over steps and layers of max/mean expert load. QB must beat no balancing."""
    torch.set_num_threads(1)

    def mean_load(log):
        values = [v for r in log[5:] for v in r["load_max_over_mean"].values()]
        return sum(values) / len(values)

    qb = mean_load(baseline)
    sign = mean_load(make_trainer(balance=BalanceConfig(method=BalanceMethod.SIGN, sign_rate=1e-2)).fit(progress=False))
    none = mean_load(make_trainer(balance=BalanceConfig(method=BalanceMethod.NONE)).fit(progress=False))
    print(f"max/mean expert load, steps 6-20, mean over layers: qb {qb:.3f}  sign {sign:.3f}  none {none:.3f}")
    assert qb < none


def test_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, cfg) == pytest.approx(0.1) and lr_factor(9, cfg) == pytest.approx(1.0)
    assert lr_factor(10, cfg) == pytest.approx(1.0) and lr_factor(100, cfg) == pytest.approx(0.1)
    assert lr_factor(55, cfg) == pytest.approx(0.55)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="qat_fraction=1.5"):
        TrainConfig(qat_fraction=1.5)
    with pytest.raises(ValueError, match="seq_len=0"):
        TrainConfig(seq_len=0)

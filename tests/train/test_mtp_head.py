"""train/mtp_head.py: self-distilling an MTP layer from a frozen target lowers its loss against the target's next-token
distributions, leaves the target's weights untouched, and leaves the layer ready to draft (eval mode, inference ops)."""

from __future__ import annotations

import torch

from openk3.config import debug
from openk3.model.batch import ForwardBatch
from openk3.train.mtp_head import mtp_loss, new_mtp_layer, teacher, train_mtp
from tests.model.conftest import build


def test_distillation_lowers_the_loss_and_leaves_the_target_alone() -> None:
    torch.set_num_threads(1)
    target = build(debug())
    before = {n: t.clone() for n, t in target.state_dict().items()}
    data = torch.randint(0, target.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(0))
    layer = new_mtp_layer(target)
    with torch.no_grad():
        h, p = teacher(target, data)
        floor = float(-(p[:, 1:] * p[:, 1:].log()).sum(-1).mean())  # the soft cross-entropy's minimum: the target's entropy
        start = float(mtp_loss(layer, data, h, p)) - floor
    losses = train_mtp(target, layer, data, steps=30, batch_size=4, lr=3e-3)
    with torch.no_grad():
        end = float(mtp_loss(layer, data, h, p)) - floor
    assert end < 0.5 * start and losses[-1] < losses[0]
    assert all(torch.equal(before[n], t) for n, t in target.state_dict().items())
    assert not layer.training
    with torch.inference_mode():
        h, _ = teacher(target, data[:1])
        x = layer(ForwardBatch.from_tokens(data[:1, 1:]), None, h[0, :-1])
        assert layer.compute_logits(x).shape == (11, target.config.vocab_size)

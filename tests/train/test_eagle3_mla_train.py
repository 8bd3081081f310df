"""Training the K3 MLA EAGLE-3 head (train/eagle3_mla_train.py through train/eagle3_head.py's loop, train/eagle3_cli.py's
export): each training-time-test step computes what drafting computes (row p of step j equals the head's chain at position
p + j over the kept latents of positions <= p, fed the true tokens); a few steps lower the loss; the exported folder is
TorchSpec's Kimi-K3 draft layout and loads back by architecture."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from openk3.config import debug
from openk3.model.eagle3 import Past
from openk3.model.eagle3_mla import Eagle3MLAHead
from openk3.model.eagle3_mla_load import load_any_eagle3
from openk3.train.eagle3_cli import export_eagle3
from openk3.train.eagle3_head import draft_vocabulary, teacher
from openk3.train.eagle3_mla_train import mla_ttt_outputs, new_eagle3_mla_head
from tests.model.conftest import build
from tests.train.test_eagle3_head import train_and_check_the_loss, training_case


def test_each_training_step_is_the_drafting_chain() -> None:
    target = build(debug())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 9), generator=g)
    head = new_eagle3_mla_head(target, draft_vocabulary(ids, 256, 40), seed=2)
    with torch.no_grad():
        for p in head.parameters():  # away from the init, so that every part matters
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        aux, _ = teacher(target, head, ids)
        steps = mla_ttt_outputs(head, ids, aux, 3)
        seq = 1
        lr, dr = head.cache_rows()
        x0, c0, kpe0 = head(ids[seq, 1:], head.fuse(aux[seq, :-1]), torch.arange(8), [Past(0, 8, torch.empty(0, *lr), torch.empty(0, *dr))])
        torch.testing.assert_close(steps[0][seq], x0, atol=1e-5, rtol=1e-5)
        for pos in (2, 5):
            cs, kpes, x = c0[: pos + 1], kpe0[: pos + 1], x0[pos]
            for j in (1, 2):  # position p + j reads t_{p+1+j} and the chain's own x
                x_new, c, kpe = head(ids[seq, pos + 1 + j : pos + 2 + j], x[None], torch.tensor([pos + j]), [Past(0, 1, cs, kpes)])
                cs, kpes, x = torch.cat([cs, c]), torch.cat([kpes, kpe]), x_new[0]
                torch.testing.assert_close(steps[j][seq, pos], x, atol=1e-5, rtol=1e-5)


def test_training_lowers_the_loss_and_the_export_loads_back(tmp_path: Path) -> None:
    target, data = training_case()
    head = new_eagle3_mla_head(target, draft_vocabulary(data, 256, 64))
    train_and_check_the_loss(target, head, data)
    export_eagle3(head, tmp_path / "e3")
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["mla_use_nope"] is True and cfg["hidden_act"] == "situ"
    back = load_any_eagle3(tmp_path / "e3", target)
    assert isinstance(back, Eagle3MLAHead)
    for name, want in head.state_dict().items():
        got = back.state_dict()[name]
        tol = 1e-2 if want.is_floating_point() else 0  # bf16 in the file
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)

"""Training an EAGLE-3 head (train/eagle3_head.py, train/eagle3_cli.py): each training-time-test step computes what
drafting computes (row p of step j equals the head's chain at position p + j over the kept keys of positions <= p, fed the
true tokens); a few steps lower the loss; the exported folder is the published format and loads back."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from openk3.config import debug
from openk3.model.eagle3 import Past
from openk3.model.eagle3_load import load_eagle3
from openk3.model.eagle3_mla import AnyEagle3Head
from openk3.model.model import K3ForCausalLM
from openk3.train.eagle3_cli import export_eagle3
from openk3.train.eagle3_head import draft_vocabulary, new_eagle3_head, teacher, train_eagle3, ttt_loss, ttt_outputs
from tests.model.conftest import build


def test_each_training_step_is_the_drafting_chain() -> None:
    target = build(debug())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 9), generator=g)
    head = new_eagle3_head(target, draft_vocabulary(ids, 256, 40), seed=2)
    with torch.no_grad():
        for p in head.parameters():  # away from the init, so that every part matters
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        aux, _ = teacher(target, head, ids)
        steps = ttt_outputs(head, ids, aux, 3)
        seq = 1
        empty = torch.empty(0, 2, 16)
        x0, k0, v0 = head(ids[seq, 1:], head.fuse(aux[seq, :-1]), torch.arange(8), [Past(0, 8, empty, empty)])
        torch.testing.assert_close(steps[0][seq], x0)
        for pos in (2, 5):
            keys, values, x = k0[: pos + 1], v0[: pos + 1], x0[pos]
            for j in (1, 2):  # position p + j reads t_{p+1+j} and the chain's own x
                x_new, k, v = head(ids[seq, pos + 1 + j : pos + 2 + j], x[None], torch.tensor([pos + j]), [Past(0, 1, keys, values)])
                keys, values, x = torch.cat([keys, k]), torch.cat([values, v]), x_new[0]
                torch.testing.assert_close(steps[j][seq, pos], x, atol=1e-5, rtol=1e-5)


def train_and_check_the_loss(target: K3ForCausalLM, head: AnyEagle3Head, data: torch.Tensor) -> None:
    """40 training steps close most of the gap between the loss and its floor, the target's own entropy (soft
    cross-entropy = entropy + KL)."""
    aux, p = teacher(target, head, data)
    with torch.no_grad():
        before = float(ttt_loss(head, data, aux, p, 3))
    train_eagle3(target, head, data, steps=40, batch_size=8, lr=3e-3)
    with torch.no_grad():
        after = float(ttt_loss(head, data, aux, p, 3))
    entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)
    floor = sum(0.8**j * float(entropy[:, 1 + j :].mean()) for j in range(3))
    assert after - floor < 0.5 * (before - floor)


def training_case() -> tuple[K3ForCausalLM, torch.Tensor]:
    """The debug target (torch seeded 0 first) and the 16 sequences of 12 ids below 64 both training tests train on."""
    torch.manual_seed(0)
    target = build(debug())
    return target, torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(3))


def test_training_lowers_the_loss_and_the_export_loads_back(tmp_path: Path) -> None:
    target, data = training_case()
    head = new_eagle3_head(target, draft_vocabulary(data, 256, 64))
    train_and_check_the_loss(target, head, data)
    export_eagle3(head, tmp_path / "e3")
    cfg = json.loads((tmp_path / "e3" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 64
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 2, 2]
    back = load_eagle3(tmp_path / "e3", target)
    for name, want in head.state_dict().items():
        got = back.state_dict()[name]
        tol = 1e-2 if want.is_floating_point() else 0  # bf16 in the file
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)

"""A new EAGLE-3 head's starting point before training (train-eagle3: train/eagle3_head.py, train/eagle3_mla_train.py)."""

from __future__ import annotations

import torch

from openk3.model.eagle3 import DraftVocabHead
from openk3.model.model import K3ForCausalLM


def init_head(head: DraftVocabHead, target: K3ForCausalLM, draft_ids: torch.Tensor, seed: int) -> None:
    """A new head's starting point, whatever its layer: norms at one, other weights small and random, lm_head and the
    final norm the target's rows for the draft vocabulary, d2t / t2d mapping it."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in name else torch.randn(p.shape, generator=g) * 0.02)
        head.lm_head.weight.copy_(target.lm_head.weight[draft_ids])
        head.norm.weight.copy_(target.model.norm.weight)
        head.d2t.copy_(draft_ids - torch.arange(len(draft_ids)))
        head.t2d.zero_().index_fill_(0, draft_ids, True)

"""Learning an MTP draft layer (model/mtp.py) for a trained target by self-distillation: the target stays frozen, and the
layer learns to give at position p, from the target's hidden state h_p and the token t_{p+1}, the target's own next-token
distribution at p + 1 (soft cross-entropy to it), over sequences the caller supplies (e.g. the target's own continuations;
the target's outputs over them are computed once, so they are held in memory: N x L x V floats).

Legend: B sequences, L tokens each, D hidden, V vocabulary.
A new layer starts from the target's last gated-MLA decoder layer (same kind and shapes, so it starts from attention and
experts that already read this model's hidden states), shared_head.norm from the target's final norm, unit enorm and
hnorm, and a small random eh_proj.
"""

from __future__ import annotations

import torch

from openk3.config import LayerKind
from openk3.model.batch import ForwardBatch
from openk3.model.model import K3ForCausalLM
from openk3.model.mtp import MTPLayer, mtp_block_config
from openk3.ops.registry import CPU_INFERENCE, OpTarget


def new_mtp_layer(target: K3ForCausalLM, seed: int = 0) -> MTPLayer:
    """An MTP layer for `target` initialised as the module docstring says (a gated-MLA MoE layer)."""
    cfg = target.config
    source = next(layer for layer in reversed(list(target.model.layers)) if layer.kind == LayerKind.MLA)
    layer = MTPLayer(mtp_block_config(cfg, LayerKind.MLA, moe=source.is_moe), target.model.embed_tokens, target.lm_head, target.ops)
    own = layer.state_dict()
    layer.load_state_dict({k: v for k, v in source.state_dict().items() if k in own}, strict=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.enorm.weight.fill_(1.0)
        layer.hnorm.weight.fill_(1.0)
        layer.shared_head.norm.weight.copy_(target.model.norm.weight)
        layer.eh_proj.weight.copy_(torch.randn(layer.eh_proj.weight.shape, generator=g) * 0.02)
    return layer.to(target.lm_head.weight.dtype)


@torch.no_grad()
def teacher(target: K3ForCausalLM, ids_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's hidden states [B, L, D] and next-token distributions [B, L, V] over the sequences."""
    b, seq_len = ids_BL.shape
    h = target.hidden_states(ForwardBatch.from_tokens(ids_BL))
    return h.view(b, seq_len, -1), target.compute_logits(h).softmax(-1).view(b, seq_len, -1)


def mtp_loss(layer: MTPLayer, ids_BL: torch.Tensor, h_BLD: torch.Tensor, p_BLV: torch.Tensor) -> torch.Tensor:
    """Soft cross-entropy of the layer's prediction at p (reading h_p and t_{p+1}) against the target's at p + 1."""
    b, seq_len, d = h_BLD.shape
    batch = ForwardBatch.from_tokens(ids_BL[:, 1:].contiguous())
    x = layer(batch, None, h_BLD[:, :-1].reshape(-1, d))
    head = layer.shared_head.head or layer.target_parts[1]  # the target's head keeps its inference ops: its plain product
    logq = torch.nn.functional.linear(layer.shared_head.norm(x), head.weight).log_softmax(-1)
    return -(p_BLV[:, 1:].reshape(b * (seq_len - 1), -1) * logq).sum(-1).mean()


def train_mtp(target: K3ForCausalLM, layer: MTPLayer, sequences: torch.Tensor, steps: int, batch_size: int = 8, lr: float = 1e-3, seed: int = 0) -> list[float]:
    """Train `layer` in place on `sequences` [N, L] (the target's outputs over them computed once, then random batches of
    `batch_size`, AdamW); the loss of every step. The layer is left in eval mode with inference ops."""
    target.requires_grad_(False)
    parts = [teacher(target, sequences[i : i + batch_size]) for i in range(0, len(sequences), batch_size)]
    h_NLD, p_NLV = torch.cat([h for h, _ in parts]), torch.cat([p for _, p in parts])
    layer.train()
    layer.select_ops(target.ops, OpTarget(training=True))
    params = [p for p in layer.parameters() if p.is_floating_point()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        rows = torch.randint(0, len(sequences), (batch_size,), generator=g)
        loss = mtp_loss(layer, sequences[rows], h_NLD[rows], p_NLV[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    layer.eval()
    layer.select_ops(target.ops, CPU_INFERENCE)
    return losses

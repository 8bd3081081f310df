"""Learning an EAGLE-3 head (model/eagle3.py) for a trained target by self-distillation with EAGLE-3's training-time test.

Legend: B sequences, L tokens each, D target hidden, H head hidden, N / G query / key-value heads, d head dim, Vd draft
vocabulary. The target stays frozen; its aux hidden states and its logits over the draft vocabulary are computed once
over the caller's sequences (B x L x Vd floats held in memory). Step j = 0 .. S - 1 of the training-time test runs the
head over every position p at once: row p reads the true token t_{p+1+j}, and fc(aux_p) at step 0 or the head's own
output of step j - 1 at row p after that (as drafting k > 1 tokens does), at RoPE position p + j; its queries see the
step-0 keys of positions <= p and, for j > 0, the keys that row p made at steps 1 .. j (the chain's own positions: EAGLE-3's
diagonal extension of the mask). Its loss is the soft cross-entropy to the target's next-token distribution at p + 1 + j
(over the draft vocabulary, as EAGLE-3 restricts it), weighted 0.8^j; rows past the window drop out.

The K3 MLA head (model/eagle3_mla.py) trains by the same loop; its steps are train/eagle3_mla_train.py's.
A new head: the draft vocabulary is the Vd most frequent tokens of the training sequences (d2t / t2d from them);
lm_head starts from the target's rows of those tokens, norm from the target's final norm, the embedding is the target's
(not trained), the rest small random.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.model.batch import ForwardBatch
from openk3.model.eagle3 import Eagle3Config, Eagle3Head
from openk3.model.eagle3_load import default_aux_layers
from openk3.model.eagle3_mla import AnyEagle3Head, Eagle3MLAHead
from openk3.model.model import K3ForCausalLM
from openk3.ops.registry import OpTarget
from openk3.train.eagle3_init import init_head
from openk3.train.eagle3_mla_train import mla_ttt_outputs

LOSS_DECAY = 0.8


def draft_vocabulary(sequences: torch.Tensor, vocab: int, size: int) -> torch.Tensor:
    """The `size` most frequent token ids of the sequences, ascending (ties to the lower id)."""
    counts = torch.bincount(sequences.flatten(), minlength=vocab).double() - torch.arange(vocab) * 1e-9
    return counts.topk(size).indices.sort().values


def new_eagle3_head(
    target: K3ForCausalLM, draft_ids: torch.Tensor, heads: int = 4, kv_heads: int = 2, intermediate: int | None = None, seed: int = 0
) -> Eagle3Head:
    cfg = target.config
    h = cfg.hidden_size
    head_cfg = Eagle3Config(
        hidden_size=h,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=h // heads,
        intermediate_size=intermediate or cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        draft_vocab_size=len(draft_ids),
        target_hidden_size=h,
        aux_layer_ids=default_aux_layers(cfg.num_hidden_layers),
        rms_norm_eps=cfg.rms_norm_eps,
    )
    head = Eagle3Head(head_cfg, target.model.embed_tokens)
    init_head(head, target, draft_ids, seed)
    return head


@torch.no_grad()
def teacher(target: K3ForCausalLM, head: AnyEagle3Head, ids_BL: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's aux hidden states [B, L, 3D] and its next-token distributions over the draft vocabulary [B, L, Vd]."""
    b, seq_len = ids_BL.shape
    h, aux = target.aux_hidden_states(ForwardBatch.from_tokens(ids_BL), None, head.config.aux_layer_ids)
    draft_ids = torch.arange(head.config.draft_vocab_size) + head.d2t
    p = target.compute_logits(h)[:, draft_ids].softmax(-1)
    return aux.view(b, seq_len, -1), p.view(b, seq_len, -1)


def _ttt_attention(q_BLND: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Step len(keys) - 1's attention: over step 0's keys causally, and over row p's own keys of steps 1 .. j."""
    b, seq_len, n, d = q_BLND.shape
    reps = n // keys[0].shape[2]

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.repeat_interleave(reps, 2).transpose(1, 2)  # [B, N, L, d]

    q = q_BLND.transpose(1, 2) / d**0.5
    scores = [q @ heads(keys[0]).transpose(-1, -2)]  # [B, N, L, L]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    scores[0] = scores[0].masked_fill(~causal, float("-inf"))
    scores += [(q * heads(k)).sum(-1, keepdim=True) for k in keys[1:]]  # [B, N, L, 1] each
    w = torch.cat(scores, -1).softmax(-1)
    out = w[..., :seq_len] @ heads(values[0])
    for i, v in enumerate(values[1:]):
        out = out + w[..., seq_len + i : seq_len + i + 1] * heads(v)
    return out.transpose(1, 2).reshape(b, seq_len, n * d)


def ttt_outputs(head: Eagle3Head, ids_BL: torch.Tensor, aux_BLA: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's output x [B, L - 1, H] of each training-time-test step (module docstring): row p of step j is what
    drafting would compute at position p + j after reading the true tokens up to t_{p+1+j}."""
    b, seq_len = ids_BL.shape
    rows = seq_len - 1  # row p = 0 .. L - 2 reads t_{p+1} at step 0
    hidden = head.fuse(aux_BLA[:, :rows])
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    attn = head.midlayer.self_attn
    n, g, d = attn.shape
    outs = []
    for j in range(min(steps, rows)):
        tokens = F.pad(ids_BL[:, 1 + j :], (0, j))[:, :rows]  # rows past the window read padding and are never scored
        residual, x2 = head.layer_input(tokens.reshape(-1), hidden.reshape(b * rows, -1))
        positions = (torch.arange(rows, device=ids_BL.device) + j).repeat(b)
        q, k, v = attn.qkv(x2, positions, head.inv_freq)
        keys.append(k.view(b, rows, g, d))
        values.append(v.view(b, rows, g, d))
        out = _ttt_attention(q.view(b, rows, n, d), keys, values)
        hidden = head.finish(residual, out.reshape(b * rows, -1)).view(b, rows, -1)
        outs.append(hidden)
    return outs


def ttt_loss(head: AnyEagle3Head, ids_BL: torch.Tensor, aux_BLA: torch.Tensor, p_BLV: torch.Tensor, steps: int) -> torch.Tensor:
    """The training-time test's weighted loss over `steps` steps: step j's row p against the target at p + 1 + j (the
    K3 MLA head's steps by train/eagle3_mla_train.py)."""
    total = aux_BLA.new_zeros(())
    rows = ids_BL.shape[1] - 1
    outs = mla_ttt_outputs(head, ids_BL, aux_BLA, steps) if isinstance(head, Eagle3MLAHead) else ttt_outputs(head, ids_BL, aux_BLA, steps)
    for j, x in enumerate(outs):
        valid = rows - j
        logq = head.lm_head(head.norm(x[:, :valid])).log_softmax(-1)
        total = total + LOSS_DECAY**j * -(p_BLV[:, 1 + j : 1 + j + valid] * logq).sum(-1).mean()
    return total


def train_eagle3(
    target: K3ForCausalLM, head: AnyEagle3Head, sequences: torch.Tensor, steps: int, ttt_steps: int = 3, batch_size: int = 8, lr: float = 2e-3, seed: int = 0
) -> list[float]:
    """Train `head` in place on `sequences` [N, L] (the teacher computed once, then random batches, AdamW with a cosine
    schedule); the loss of every step. The head is left in eval mode with inference ops."""
    target.requires_grad_(False)
    parts = [teacher(target, head, sequences[i : i + batch_size]) for i in range(0, len(sequences), batch_size)]
    aux_N, p_N = torch.cat([a for a, _ in parts]), torch.cat([p for _, p in parts])
    head.train()
    head.select_ops(OpTarget(training=True))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1))
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        rows = torch.randint(0, len(sequences), (batch_size,), generator=g)
        loss = ttt_loss(head, sequences[rows], aux_N[rows], p_N[rows], ttt_steps)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    head.eval()
    head.select_ops(OpTarget())
    return losses

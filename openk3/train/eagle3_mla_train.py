"""The K3 MLA EAGLE-3 head's part of training (train/eagle3_head.py runs the loop): a new head and its training-time test.

Legend: B sequences, L tokens each, R = L - 1 rows, H hidden, Hn heads, Dn/Dr/Dv qk_nope/qk_rope/v head dims, Lr
kv_lora_rank. The training-time test is the Llama head's (train/eagle3_head.py): step j runs the head over every row p at
once, reading t_{p+1+j} and fc(aux_p) (step 0) or its own output of step j - 1; its queries see step 0's keys of
positions <= p and row p's own keys of steps 1 .. j (EAGLE-3's diagonal extension). Here the keys and values are expanded
from each step's latent through kv_b_proj (NoPE: k_pe joins unrotated), as the drafting forward's "mla_prefill" does,
so each step equals the drafting chain (tests/train/test_eagle3_mla_train.py).
A new head takes the target's MLA dimensions and MLP activation (its gated-MLA layers' shape), the target's width for
the MLP, and is initialised as train/eagle3_head.py's Llama head is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openk3.model.eagle3_load import default_aux_layers
from openk3.model.eagle3_mla import Eagle3MLAConfig, Eagle3MLAHead
from openk3.model.model import K3ForCausalLM
from openk3.train.eagle3_init import init_head


def new_eagle3_mla_head(target: K3ForCausalLM, draft_ids: torch.Tensor, seed: int = 0) -> Eagle3MLAHead:
    cfg = target.config
    head_cfg = Eagle3MLAConfig(
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        draft_vocab_size=len(draft_ids),
        target_hidden_size=cfg.hidden_size,
        aux_layer_ids=default_aux_layers(cfg.num_hidden_layers),
        mla=cfg.mla,
        activation=cfg.hidden_act,
        situ_beta=cfg.situ_beta,
        situ_linear_beta=cfg.situ_linear_beta,
        rms_norm_eps=cfg.rms_norm_eps,
    )
    head = Eagle3MLAHead(head_cfg, cfg, target.model.embed_tokens)
    init_head(head, target, draft_ids, seed)
    return head


def _ttt_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], scale: float) -> torch.Tensor:
    """Step len(steps) - 1's attention [B, R, Hn, Dv]: over step 0's keys causally and row p's own keys of steps 1 .. j.
    `steps`: per step (k_nope [B, R, Hn, Dn], k_pe [B, R, Dr], v [B, R, Hn, Dv])."""
    rows = q_nope.shape[1]
    k0, kpe0, v0 = steps[0]
    scores = [torch.einsum("bphd,bshd->bhps", q_nope, k0) + torch.einsum("bphr,bsr->bhps", q_pe, kpe0)]
    causal = torch.ones(rows, rows, dtype=torch.bool, device=q_nope.device).tril()
    scores[0] = scores[0].masked_fill(~causal, float("-inf"))
    scores += [(torch.einsum("bphd,bphd->bhp", q_nope, k) + torch.einsum("bphr,bpr->bhp", q_pe, kpe))[..., None] for k, kpe, _ in steps[1:]]
    w = (torch.cat(scores, -1) * scale).softmax(-1)  # [B, Hn, R, R + j]
    out = torch.einsum("bhps,bshd->bphd", w[..., :rows], v0)
    for i, (_, _, v) in enumerate(steps[1:]):
        out = out + w[..., rows + i].transpose(1, 2)[..., None] * v
    return out


def mla_ttt_outputs(head: Eagle3MLAHead, ids_BL: torch.Tensor, aux_BLA: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's output x [B, L - 1, H] of each training-time-test step (train/eagle3_head.py ttt_outputs, for this head)."""
    b, seq_len = ids_BL.shape
    rows = seq_len - 1
    layer = head.midlayer
    attn = layer.self_attn
    hidden = head.fuse(aux_BLA[:, :rows])
    kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    outs = []
    for j in range(min(steps, rows)):
        tokens = F.pad(ids_BL[:, 1 + j :], (0, j))[:, :rows]  # rows past the window read padding and are never scored
        x2 = torch.cat([layer.input_layernorm(head.embed(tokens)), layer.hidden_norm(hidden)], -1)
        inp = attn.project(x2.reshape(b * rows, -1))
        c, kpe = inp.latent_TR.split([attn.lora, attn.rope], -1)
        kv = attn.kv_b_proj(c).view(b, rows, attn.num_heads, attn.nope + attn.v_dim)
        kept.append((kv[..., : attn.nope], kpe.view(b, rows, -1), kv[..., attn.nope :]))
        q_nope, q_pe = inp.q_nope.view(b, rows, attn.num_heads, -1), inp.q_pe.view(b, rows, attn.num_heads, -1)
        out = _ttt_attention(q_nope, q_pe, kept, attn.scale).reshape(b * rows, attn.num_heads, attn.v_dim)
        x = hidden.reshape(b * rows, -1) + attn.output(out, inp.gate_logits, x2.dtype)
        hidden = (x + layer.mlp(layer.post_attention_layernorm(x))).view(b, rows, -1)
        outs.append(hidden)
    return outs

"""MTPLayer: the release's multi-token-prediction layer (DeepSeek-V3's layout, `num_nextn_predict_layers: 1`), run as a draft.

Legend: T packed tokens, D hidden, V vocab, M rows whose logits are wanted.
At position p the layer reads the target's last hidden state h_p (after the final norm: what the target's head reads,
K3ForCausalLM.hidden_states) and the embedding of the token after it, t_{p+1}, and predicts t_{p+2}:

    x = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])          # [T, 2D] -> [T, D], embedding first as in the checkpoint
    x = x + attention(input_layernorm(x));  x = x + mlp(post_attention_layernorm(x))   # one decoder layer, plain residuals
    logits = lm_head(shared_head.norm(x))

The decoder layer is one of the target's kinds (gated MLA or KDA, MoE or dense MLP, as its tensors say), with a cache of
its own (one layer). For k > 1 drafts the same layer runs again on its own output x in place of h (as vLLM and SGLang
chain one MTP layer). embed and lm_head are the target's unless the checkpoint ships the layer its own copies
(`embed_tokens`, `shared_head.head`, as DeepSeek-V3's does). Unlike vLLM's deepseek_mtp the first position's embedding is
not zeroed: the paper's definition has no such mask, and it only changes what later positions attend to.
"""

from __future__ import annotations

import torch
from torch import nn

from openk3.config import LayerKind, ModelConfig
from openk3.model.batch import CacheTensors, ForwardBatch
from openk3.model.layers import Linear, RMSNorm
from openk3.model.model import DecoderLayer, OpChoice, select_block_ops
from openk3.model.moe import LocalExperts
from openk3.ops.registry import CPU_INFERENCE, OpTarget


def mtp_block_config(config: ModelConfig, kind: LayerKind, moe: bool) -> ModelConfig:
    """The config of the MTP layer's decoder layer as a one-layer model (its cache is laid out from it): the target's
    dimensions, the layer's kind, MoE or dense, plain residuals (an MTP layer has no Attention Residuals mixers)."""
    return config.replace(
        num_hidden_layers=1,
        mla_layers=(0,) if kind == LayerKind.MLA else (),
        first_k_dense_replace=0 if moe else 1,
        attn_res_block_size=None,
        name=f"{config.name}-mtp",
    )


class SharedHead(nn.Module):
    """`shared_head.norm` before the head; `shared_head.head` only where the checkpoint ships the layer its own head."""

    def __init__(self, hidden: int, vocab: int, eps: float, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.head = Linear(hidden, vocab, bias=False) if own_head else None


class MTPLayer(DecoderLayer):
    """The MTP layer: its decoder layer's parameters at the top (`input_layernorm`, `self_attn.*`, `block_sparse_moe.*` or
    `mlp.*`), plus `enorm`, `hnorm`, `eh_proj` and `shared_head`: the checkpoint's names after `model.layers.{n}.`.
    `embed` and `lm_head` are the target's (held, not registered: they are not this layer's parameters)."""

    def __init__(
        self,
        config: ModelConfig,
        embed: nn.Embedding,
        lm_head: nn.Linear,
        ops: OpChoice | None = None,
        own_embedding: bool = False,
        own_head: bool = False,
    ) -> None:
        if config.num_hidden_layers != 1 or config.attn_res_block_size is not None:
            raise ValueError(f"MTPLayer: config must describe one plain-residual layer (mtp_block_config), got {config.num_hidden_layers} layers")
        super().__init__(config, 0, ops or OpChoice())
        self.config = config
        d, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(d, eps)
        self.hnorm = RMSNorm(d, eps)
        self.eh_proj = Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(d, config.vocab_size, eps, own_head)
        self.embed_tokens = nn.Embedding(config.vocab_size, d) if own_embedding else None
        self.target_parts: tuple[nn.Embedding, nn.Linear] = (embed, lm_head)  # a tuple, so nn.Module does not register the target's modules here

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return (self.embed_tokens or self.target_parts[0])(input_ids)

    def forward(self, batch: ForwardBatch, cache: CacheTensors | None, hidden_TD: torch.Tensor) -> torch.Tensor:
        """The layer's output x [T, D] for every row: row i reads token batch.input_ids[i] (the token after the one h_i
        was computed at) and `hidden_TD[i]`; the next step of a chain reads x in place of the target's hidden state."""
        e = self.enorm(self.embed(batch.input_ids))
        x = self.eh_proj(torch.cat([e, self.hnorm(hidden_TD.to(e.dtype))], dim=-1))
        x = x + self.attention(x, batch, cache, 0)
        return x + self.feed_forward(self.post_attention_layernorm(x))

    def compute_logits(self, x_MD: torch.Tensor) -> torch.Tensor:
        head = self.shared_head.head or self.target_parts[1]
        return head(self.shared_head.norm(x_MD))

    def select_ops(self, ops: OpChoice, target: OpTarget = CPU_INFERENCE) -> None:
        """The implementations by name, as K3ForCausalLM.select_ops (the engine passes the target's own OpChoice)."""
        backend = self.block_sparse_moe.backend if self.is_moe else None
        select_block_ops(self, ops, target, backend.impl if isinstance(backend, LocalExperts) else ops.moe)

"""Test oracle: a CPU transcription of the official MoonViT3d vision tower and projector, the code the released
`KimiK3ForConditionalGeneration` runs. A reference for tests only; openk3's model (openk3/model/vision*.py) is written
separately and compared against it.

Transcribed from `modeling_kimi_k3.py` of https://huggingface.co/moonshotai/Kimi-K3 (its header: "The code is based on
llava ... but modified for Kimi-K3"), as stored in the code library this project searches (stored file id 58920436853; the
library did not report the mirroring repository): the classes Learnable2DInterpPosEmbDivided_fixed,
MoonVision3dPatchEmbed, Rope2DPosEmbRepeated, MLP2, MoonViTEncoderLayer, MoonViT3dEncoder, tpool_patch_merger,
MoonViT3dPretrainedModel, PatchMergerMLP, PatchMergerMLPV2, VisionTowerConfig / ProjectorConfig and the functions
apply_rope, get_1d_sincos_pos_embed(_from_grid), get_rope_shape, eager_attention.
Cross-checked against Kimi K2.5's modeling_kimi_k25.py (the same classes without K3's switches) as Ascend/MindSpeed-MM
holds it: mindspeed_mm/fsdp/models/kimik2_5/modeling_kimi_k25.py at d300ee2852601b3c907406467ee29720b281f7ad.
Licence: the released model repository's (Moonshot AI's modified MIT licence for its Kimi releases); kept under tests/ as
an oracle only, never imported by openk3.

Changes made for a CPU oracle, none of them numerical:
- `get_rope_shape` without @torch.compile and its warm-up decorator; the "eager" attention path (flash-attn is CUDA only);
- transformers' PreTrainedModel / PretrainedConfig replaced by nn.Module and a SimpleNamespace config, and
  PytorchGELUTanh by its definition nn.GELU(approximate="tanh");
- the rotary table built in __init__ instead of lazily under `hasattr`; asserts kept as asserts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def eager_attention(q, k, v, q_cu_seqlens=None, k_cu_seqlens=None, **kwargs):  # type: ignore[no-untyped-def]
    seq_length = q.shape[0]
    attention_mask = torch.zeros([1, seq_length, seq_length], device=q.device, dtype=torch.bool)
    for i in range(1, len(q_cu_seqlens)):
        attention_mask[..., q_cu_seqlens[i - 1] : q_cu_seqlens[i], q_cu_seqlens[i - 1] : q_cu_seqlens[i]] = True
    q = q.transpose(0, 1)
    k = k.transpose(0, 1)
    v = v.transpose(0, 1)
    attn_weight = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    attn_weight = attn_weight.masked_fill(~attention_mask, torch.finfo(attn_weight.dtype).min)
    attn_weight = torch.softmax(attn_weight, dim=-1, dtype=torch.float32).to(q.dtype)
    attn_output = attn_weight @ v
    attn_output = attn_output.transpose(0, 1)
    return attn_output.reshape(seq_length, -1)


def get_rope_shape(org, interpolation_mode, shape):  # type: ignore[no-untyped-def]
    return F.interpolate(org.permute((2, 0, 1)).unsqueeze(0), size=shape, mode=interpolation_mode).squeeze(0).permute((1, 2, 0)).flatten(end_dim=1)


def apply_rope(xq, xk, freqs_cis):  # type: ignore[no-untyped-def]
    freqs_cis = freqs_cis.unsqueeze(-2)
    xq_ = torch.view_as_complex(xq.float().view(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().view(*xq.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(-2)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(-2)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def get_1d_sincos_pos_embed_from_grid(embed_dim, pos):  # type: ignore[no-untyped-def]
    assert embed_dim % 2 == 0
    omega = np.arange(embed_dim // 2, dtype=np.float32)
    omega /= embed_dim / 2.0
    omega = 1.0 / 10000**omega
    pos = pos.reshape(-1)
    out = np.einsum("m,d->md", pos, omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def get_1d_sincos_pos_embed(embed_dim, t_size):  # type: ignore[no-untyped-def]
    return get_1d_sincos_pos_embed_from_grid(embed_dim, np.arange(t_size, dtype=np.float32))


class Learnable2DInterpPosEmbDivided_fixed(nn.Module):
    def __init__(self, height, width, num_frames, dim, interpolation_mode="bicubic"):  # type: ignore[no-untyped-def]
        super().__init__()
        self.num_frames, self.dim, self.interpolation_mode = num_frames, dim, interpolation_mode
        self.weight = nn.Parameter(torch.empty(height, width, dim))
        self.register_buffer("time_weight", torch.from_numpy(get_1d_sincos_pos_embed(dim, num_frames)).float().unsqueeze(1), persistent=False)
        nn.init.normal_(self.weight)

    def forward(self, x, grid_thws):  # type: ignore[no-untyped-def]
        pos_embs = []
        for t, h, w in grid_thws.tolist():
            assert t <= self.num_frames
            if (h, w) == self.weight.shape[:-1]:
                pos_emb_2d = self.weight.flatten(end_dim=1)
            else:
                pos_emb_2d = get_rope_shape(self.weight, interpolation_mode=self.interpolation_mode, shape=(h, w))
            if t == 1:
                pos_emb_3d = pos_emb_2d
            else:
                pos_emb_3d = pos_emb_2d.unsqueeze(0).repeat(t, 1, 1) + self.time_weight[0:t]  # type: ignore[index]
            pos_embs.append(pos_emb_3d.reshape(-1, pos_emb_3d.shape[-1]))
        return x + torch.cat(pos_embs)


class MoonVision3dPatchEmbed(nn.Module):
    def __init__(self, out_dim, patch_size, pos_emb_height, pos_emb_width, pos_emb_time, patch_embed_proj_bias, pos_emb_interpolation_mode):  # type: ignore[no-untyped-def]
        super().__init__()
        self.proj = nn.Conv2d(3, out_dim, kernel_size=(patch_size, patch_size), stride=(patch_size, patch_size), bias=patch_embed_proj_bias)
        self.pos_emb = Learnable2DInterpPosEmbDivided_fixed(pos_emb_height, pos_emb_width, pos_emb_time, out_dim, pos_emb_interpolation_mode)

    def forward(self, x, grid_thws):  # type: ignore[no-untyped-def]
        x = self.proj(x).view(x.size(0), -1)
        return self.pos_emb(x, grid_thws)


class Rope2DPosEmbRepeated(nn.Module):
    def __init__(self, dim, max_height, max_width, theta_base=10000):  # type: ignore[no-untyped-def]
        super().__init__()
        assert dim % 4 == 0
        self.dim, self.max_height, self.max_width, self.theta_base = dim, max_height, max_width, theta_base
        self.freqs_cis = self._precompute_freqs_cis()

    def _precompute_freqs_cis(self):  # type: ignore[no-untyped-def]
        N = self.max_height * self.max_width
        flat_pos = torch.arange(0, N).float()
        x_pos = flat_pos % self.max_width
        y_pos = flat_pos // self.max_width
        dim_range = torch.arange(0, self.dim, 4)[: (self.dim // 4)].float()
        freqs = 1.0 / (self.theta_base ** (dim_range / self.dim))
        x_freqs = torch.outer(x_pos, freqs).float()
        y_freqs = torch.outer(y_pos, freqs).float()
        x_cis = torch.polar(torch.ones_like(x_freqs), x_freqs)
        y_cis = torch.polar(torch.ones_like(y_freqs), y_freqs)
        freqs_cis = torch.cat([x_cis.unsqueeze(dim=-1), y_cis.unsqueeze(dim=-1)], dim=-1)
        return freqs_cis.reshape(self.max_height, self.max_width, -1)

    def get_freqs_cis(self, grid_thws):  # type: ignore[no-untyped-def]
        shapes = grid_thws.tolist()
        assert all(1 <= h <= self.max_height and 1 <= w <= self.max_width for t, h, w in shapes)
        return torch.cat([self.freqs_cis[:h, :w].reshape(-1, self.dim // 2).repeat(t, 1) for t, h, w in shapes], dim=0)


class MLP2(nn.Module):
    def __init__(self, dims, activation, bias=True):  # type: ignore[no-untyped-def]
        super().__init__()
        self.fc0 = nn.Linear(dims[0], dims[1], bias=bias)
        self.fc1 = nn.Linear(dims[1], dims[2], bias=bias)
        self.activation = activation

    def forward(self, x):  # type: ignore[no-untyped-def]
        return self.fc1(self.activation(self.fc0(x)))


class MoonViTEncoderLayer(nn.Module):
    def __init__(self, num_heads, hidden_dim, mlp_dim, qkv_hidden_size=None, norm_type="layernorm", activation=None, attn_bias=False, linear_bias=True):  # type: ignore[no-untyped-def]
        super().__init__()
        self.num_heads = num_heads
        self.qkv_hidden_size = hidden_dim if qkv_hidden_size is None else qkv_hidden_size
        self.hidden_size_per_attention_head = self.qkv_hidden_size // self.num_heads
        self.norm0: nn.Module
        self.norm1: nn.Module
        if norm_type == "layernorm":
            self.norm0, self.norm1 = nn.LayerNorm(hidden_dim), nn.LayerNorm(hidden_dim)
        else:
            self.norm0, self.norm1 = nn.RMSNorm(hidden_dim), nn.RMSNorm(hidden_dim)
        self.mlp = MLP2([hidden_dim, mlp_dim, hidden_dim], activation, bias=linear_bias)
        self.wqkv = nn.Linear(hidden_dim, self.qkv_hidden_size * 3, bias=attn_bias)
        self.wo = nn.Linear(self.qkv_hidden_size, hidden_dim, bias=attn_bias)

    def attention_qkvpacked(self, x, cu_seqlens, max_seqlen, rope_freqs_cis=None):  # type: ignore[no-untyped-def]
        xqkv = self.wqkv(x)
        qkv_shape = xqkv.size()[:-1] + (3, self.num_heads, self.hidden_size_per_attention_head)
        xqkv = xqkv.view(*qkv_shape)
        xq, xk, xv = torch.unbind(xqkv, dim=-3)
        xq, xk = apply_rope(xq, xk, rope_freqs_cis)
        attn_out = eager_attention(xq, xk, xv, q_cu_seqlens=cu_seqlens, k_cu_seqlens=cu_seqlens)
        return self.wo(attn_out)

    def forward(self, hidden_states, cu_seqlens, max_seqlen, rope_freqs_cis=None):  # type: ignore[no-untyped-def]
        residual = hidden_states
        hidden_states = self.norm0(hidden_states)
        hidden_states = self.attention_qkvpacked(hidden_states, cu_seqlens, max_seqlen, rope_freqs_cis)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.norm1(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class MoonViT3dEncoder(nn.Module):
    def __init__(self, hidden_dim, num_layers, block_cfg):  # type: ignore[no-untyped-def]
        super().__init__()
        qkv_hidden_size = block_cfg["hidden_dim"] if block_cfg.get("qkv_hidden_size") is None else block_cfg["qkv_hidden_size"]
        self.rope_2d = Rope2DPosEmbRepeated(qkv_hidden_size // block_cfg["num_heads"], 512, 512)
        self.blocks = nn.ModuleList([MoonViTEncoderLayer(**block_cfg) for _ in range(num_layers)])
        norm_type = block_cfg.get("norm_type", "layernorm")
        self.final_layernorm = nn.LayerNorm(hidden_dim) if norm_type == "layernorm" else nn.RMSNorm(hidden_dim)

    def forward(self, hidden_states, grid_thws):  # type: ignore[no-untyped-def]
        rope_freqs_cis = self.rope_2d.get_freqs_cis(grid_thws=grid_thws)
        lengths = torch.cat((torch.zeros(1, dtype=grid_thws.dtype), grid_thws[:, 0] * grid_thws[:, 1] * grid_thws[:, 2]))
        max_seqlen = lengths.max()
        cu_seqlens = lengths.cumsum(dim=0, dtype=torch.int32)
        for block in self.blocks:
            hidden_states = block(hidden_states, cu_seqlens, max_seqlen, rope_freqs_cis=rope_freqs_cis)
        return self.final_layernorm(hidden_states)


def tpool_patch_merger(x, grid_thws, merge_kernel_size=(2, 2)):  # type: ignore[no-untyped-def]
    d_model = x.size(-1)
    outputs = []
    pre_sum = 0
    for t, h, w in grid_thws.tolist():
        seq = x[pre_sum : pre_sum + t * h * w]
        kernel_height, kernel_width = merge_kernel_size
        new_height, new_width = h // kernel_height, w // kernel_width
        reshaped_seq = seq.view(t, new_height, kernel_height, new_width, kernel_width, d_model)
        reshaped_seq = reshaped_seq.permute(0, 1, 3, 2, 4, 5).contiguous().mean(dim=0)
        outputs.append(reshaped_seq.view(new_height * new_width, kernel_height * kernel_width, -1))
        pre_sum += t * h * w
    return outputs


class MoonViT3dPretrainedModel(nn.Module):
    def __init__(self, config):  # type: ignore[no-untyped-def]
        super().__init__()
        self.merge_kernel_size = config.merge_kernel_size
        self.patch_embed = MoonVision3dPatchEmbed(
            out_dim=config.hidden_size,
            patch_size=config.patch_size,
            pos_emb_height=config.init_pos_emb_height,
            pos_emb_width=config.init_pos_emb_width,
            pos_emb_time=config.init_pos_emb_time,
            patch_embed_proj_bias=config.patch_embed_proj_bias,
            pos_emb_interpolation_mode=config.pos_emb_interpolation_mode,
        )
        self.encoder = MoonViT3dEncoder(
            hidden_dim=config.hidden_size,
            num_layers=config.num_hidden_layers,
            block_cfg={
                "num_heads": config.num_attention_heads,
                "hidden_dim": config.hidden_size,
                "qkv_hidden_size": config.qkv_hidden_size,
                "mlp_dim": config.intermediate_size,
                "norm_type": config.norm_type,
                "activation": nn.GELU(approximate="tanh"),
                "attn_bias": config.attn_bias,
                "linear_bias": config.linear_bias,
            },
        )

    def forward(self, pixel_values, grid_thws):  # type: ignore[no-untyped-def]
        """Returns (the encoder's hidden states [L, D], the merged list of [N_i, kh kw, D])."""
        hidden_states = self.patch_embed(pixel_values, grid_thws)
        hidden_states = self.encoder(hidden_states, grid_thws)
        return hidden_states, tpool_patch_merger(hidden_states, grid_thws, merge_kernel_size=self.merge_kernel_size)


class PatchMergerMLP(nn.Module):
    def __init__(self, config):  # type: ignore[no-untyped-def]
        super().__init__()
        eps = config.projector_ln_eps
        self.hidden_size = config.mm_hidden_size * (config.merge_kernel_size[0] * config.merge_kernel_size[1])
        self.pre_norm = nn.LayerNorm(config.mm_hidden_size, eps=eps)
        self.proj = nn.Sequential(nn.Linear(self.hidden_size, self.hidden_size), nn.GELU(), nn.Linear(self.hidden_size, config.hidden_size))

    def forward(self, x):  # type: ignore[no-untyped-def]
        return [self.proj(self.pre_norm(item).view(item.shape[0], -1)) for item in x]


class PatchMergerMLPV2(nn.Module):
    def __init__(self, config):  # type: ignore[no-untyped-def]
        super().__init__()
        eps = config.projector_ln_eps
        self.hidden_size = config.mm_hidden_size * (config.merge_kernel_size[0] * config.merge_kernel_size[1])
        self.proj = nn.Sequential(
            nn.Linear(self.hidden_size, self.hidden_size, bias=False),
            nn.GELU(),
            nn.Linear(self.hidden_size, config.hidden_size, bias=False),
        )
        self.post_norm = nn.RMSNorm(config.hidden_size, eps=eps)

    def forward(self, x):  # type: ignore[no-untyped-def]
        lengths = [item.shape[0] for item in x]
        x = torch.concat([item.view(item.shape[0], -1) for item in x], dim=0)
        x = self.post_norm(self.proj(x))
        return torch.split(x, lengths, dim=0)


def reference_from_vision_config(vc: dict) -> tuple[MoonViT3dPretrainedModel, nn.Module]:  # type: ignore[type-arg]
    """The tower and the projector of a config.json `vision_config`, with VisionTowerConfig's / ProjectorConfig's getattr
    defaults for absent keys (as modeling_kimi_k3.py reads them)."""
    tower = SimpleNamespace(
        patch_size=vc["patch_size"],
        init_pos_emb_height=vc["init_pos_emb_height"],
        init_pos_emb_width=vc["init_pos_emb_width"],
        init_pos_emb_time=vc["init_pos_emb_time"],
        num_attention_heads=vc["vt_num_attention_heads"],
        num_hidden_layers=vc["vt_num_hidden_layers"],
        hidden_size=vc["vt_hidden_size"],
        intermediate_size=vc["vt_intermediate_size"],
        merge_kernel_size=vc["merge_kernel_size"],
        qkv_hidden_size=vc.get("qkv_hidden_size"),
        norm_type=vc.get("norm_type", "layernorm"),
        attn_bias=vc.get("attn_bias", True),
        patch_embed_proj_bias=vc.get("patch_embed_proj_bias", True),
        linear_bias=vc.get("linear_bias", True),
        pos_emb_interpolation_mode=vc.get("pos_emb_interpolation_mode", "bilinear"),
    )
    proj = SimpleNamespace(
        mm_hidden_size=vc["mm_hidden_size"],
        hidden_size=vc["text_hidden_size"],
        merge_kernel_size=vc["merge_kernel_size"],
        projector_ln_eps=vc["projector_ln_eps"],
    )
    projector = PatchMergerMLPV2(proj) if vc["mm_projector_type"] == "patchmergerv2" else PatchMergerMLP(proj)
    return MoonViT3dPretrainedModel(tower), projector


def reference_forward(
    tower: MoonViT3dPretrainedModel, projector: nn.Module, pixels: torch.Tensor, grids: Sequence[Sequence[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states [L, D], projector output [N, T] with the images' rows concatenated)."""
    hidden, merged = tower(pixels, torch.tensor(grids, dtype=torch.long))
    return hidden, torch.cat(list(projector(merged)))

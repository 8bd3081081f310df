"""The vision encoder's cost per image: FLOPs, weight and activation bytes, and time on an accelerator, for the MoonViT3d
tower and projector (model/vision.py, vision_projector.py) on one image of (t, h, w) patches.

Counting multiply-adds as 2 FLOPs, with L = t h w patches, D the tower width, Q the attention width, I the MLP width,
C P^2 the pixels of a patch, N = (h / kh)(w / kw) merged tokens, k = kh kw, T the text width:
    patch embedding 2 L (C P^2) D;  per block: wqkv 2 L D 3Q, wo 2 L Q D, MLP 2 * 2 L D I, attention 2 * 2 L^2 Q
    (scores and the weighted sum, bidirectional over the image's L patches); projector 2 N (k D)^2 + 2 N (k D) T.
Time: the GEMMs at `gemm` x peak bf16, the attention at `attention` x peak, the weights streamed once at `hbm` x the
memory bandwidth, whichever bound is larger per part (a roofline with the planner's Efficiency fractions).
Activation bytes: the widest live tensor of a block ([L, max(3Q, I)]) plus the residual [L, D], in bf16; attention is
taken as a fused kernel (no [L, L] scores kept).
"""

from __future__ import annotations

from dataclasses import dataclass

from openk3.config.vision import VisionConfig
from openk3.planner.efficiency import Efficiency
from openk3.planner.hardware import Accelerator

BF16 = 2


@dataclass(frozen=True)
class VisionCost:
    gemm_flops: float
    attention_flops: float
    weight_bytes: float
    activation_bytes: float
    num_tokens: int  # merged tokens the image becomes in the prompt

    @property
    def flops(self) -> float:
        return self.gemm_flops + self.attention_flops

    def seconds(self, acc: Accelerator, eff: Efficiency) -> float:
        compute = self.gemm_flops / (acc.bf16_flops * eff.gemm) + self.attention_flops / (acc.bf16_flops * eff.attention)
        return max(compute, self.weight_bytes / (acc.hbm_bw * eff.hbm))


def vision_cost(v: VisionConfig, grid: tuple[int, int, int]) -> VisionCost:
    """The cost of one image or video chunk of `grid` = (t, h, w) patches (module docstring)."""
    t, h, w = grid
    kh, kw = v.merge_kernel_size
    if min(grid) < 1 or h % kh or w % kw:
        raise ValueError(f"grid {grid}: (t, h, w) must be positive with h, w multiples of the merge kernel {kh}x{kw}")
    patches, d, q, inner = t * h * w, v.hidden_size, v.attn_width, v.intermediate_size
    patch_in = v.in_channels * v.patch_size**2
    merged, k = (h // kh) * (w // kw), kh * kw
    block = 2 * patches * d * 3 * q + 2 * patches * q * d + 2 * 2 * patches * d * inner
    projector = 2 * merged * (k * d) ** 2 + 2 * merged * k * d * v.text_hidden_size
    gemm = 2 * patches * patch_in * d + v.num_hidden_layers * block + projector
    attention = v.num_hidden_layers * 2 * 2 * patches**2 * q
    per_block_weights = d * 3 * q + q * d + 2 * d * inner
    weights = patch_in * d + v.pos_emb_height * v.pos_emb_width * d + v.num_hidden_layers * per_block_weights
    weights += (k * d) ** 2 + k * d * v.text_hidden_size
    activations = patches * (max(3 * q, inner) + d) * BF16
    return VisionCost(float(gemm), float(attention), float(weights * BF16), float(activations), merged)

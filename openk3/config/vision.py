"""The MoonViT vision tower's configuration: K3's `vision_config` (the MoonViT3d tower Kimi K2.5 introduced, with K3's
switches: a wider attention width `qkv_hidden_size`, RMSNorm, no biases, bilinear position interpolation, the
`patchmergerv2` projector), read from and written to config.json.

Every key of a `vision_config` is either read, checked against the one value the reference code implements (and refused
with its name otherwise), or listed in IGNORED with the reason; any other key is an error naming it. A key that is absent
takes the default of the release's own modelling code (modeling_kimi_k3.py's `getattr(config, key, default)`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from openk3.checks import check_int, check_number, fail


class VisionNorm(str, enum.Enum):
    LAYERNORM = "layernorm"  # nn.LayerNorm(D): weight and bias, eps 1e-5 (Kimi K2.5)
    RMSNORM = "rmsnorm"  # nn.RMSNorm(D) with eps=None: the machine epsilon of the input's dtype (K3)


class Projector(str, enum.Enum):
    PATCHMERGER = "patchmerger"  # LayerNorm per patch, then Linear -> GELU -> Linear with biases (Kimi K2.5)
    PATCHMERGER_V2 = "patchmergerv2"  # bias-free Linear -> GELU -> Linear, then RMSNorm (K3)


INTERPOLATIONS = ("bilinear", "bicubic")
ROPE_MAX_GRID = 512  # the reference's Rope2DPosEmbRepeated(head_dim, 512, 512): the largest patch grid side it encodes


@dataclass(frozen=True)
class VisionConfig:
    hidden_size: int  # D, the tower's width (vt_hidden_size; the projector's mm_hidden_size)
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int  # the blocks' MLP width
    text_hidden_size: int  # the projector's output width (the text model's hidden_size)
    qkv_hidden_size: int | None = None  # attention width H * K; None: hidden_size
    patch_size: int = 14
    pos_emb_height: int = 64  # the learned position table's grid (init_pos_emb_height x init_pos_emb_width)
    pos_emb_width: int = 64
    pos_emb_time: int = 4  # the most frames one chunk may hold (the fixed sin-cos time table's length)
    merge_kernel_size: tuple[int, int] = (2, 2)
    norm: VisionNorm = VisionNorm.LAYERNORM
    attn_bias: bool = True
    linear_bias: bool = True  # the blocks' MLP
    patch_embed_bias: bool = True
    pos_emb_interpolation: str = "bilinear"
    projector: Projector = Projector.PATCHMERGER
    projector_ln_eps: float = 1e-5
    in_channels: int = 3

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "text_hidden_size", "patch_size"):
            check_int("VisionConfig", name, getattr(self, name), low=1)
        for name in ("pos_emb_height", "pos_emb_width", "pos_emb_time", "in_channels"):
            check_int("VisionConfig", name, getattr(self, name), low=1)
        check_int("VisionConfig", "qkv_hidden_size", self.qkv_hidden_size, low=1, optional=True)
        if self.attn_width % self.num_attention_heads:
            fail("VisionConfig", "num_attention_heads", self.num_attention_heads, f"a divisor of the attention width {self.attn_width}")
        if self.head_dim % 4:
            fail("VisionConfig", "qkv_hidden_size", self.qkv_hidden_size, f"a width whose head size ({self.head_dim}) is a multiple of 4 (2D rotary)")
        if self.hidden_size % 2:
            fail("VisionConfig", "hidden_size", self.hidden_size, "an even width (the sin-cos time table)")
        if len(self.merge_kernel_size) != 2 or any(not isinstance(k, int) or k < 1 for k in self.merge_kernel_size):
            fail("VisionConfig", "merge_kernel_size", self.merge_kernel_size, "two positive integers (kh, kw)")
        if self.pos_emb_interpolation not in INTERPOLATIONS:
            fail("VisionConfig", "pos_emb_interpolation", self.pos_emb_interpolation, f"one of {list(INTERPOLATIONS)}")
        check_number("VisionConfig", "projector_ln_eps", self.projector_ln_eps, low=0)

    @property
    def attn_width(self) -> int:
        return self.qkv_hidden_size if self.qkv_hidden_size is not None else self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.attn_width // self.num_attention_heads

    @property
    def merged_size(self) -> int:
        """Width of one merged token: kh * kw patches side by side."""
        return self.hidden_size * self.merge_kernel_size[0] * self.merge_kernel_size[1]


# key -> the only value the reference implements (another value is refused by name)
FIXED = {
    "pos_emb_type": "divided_fixed",
    "merge_type": "sd2_tpool",
    "video_attn_type": "spatial_temporal",
    "mlp_type": "mlp2",
    "activation_func": "gelu_pytorch_tanh",  # the blocks' MLP (the code hardcodes PytorchGELUTanh)
    "projector_hidden_act": "gelu",  # the projector (the code hardcodes nn.GELU(), the exact erf form)
}
IGNORED = {
    "model_type": "a name",
    "_attn_implementation": "the reference's kernel choice; openk3 picks its attention by name (OpChoice.vision_attn)",
    "torch_dtype": "load_model's dtype decides",
    "dtype": "load_model's dtype decides",
    "media_placeholder_token_id": "the placeholder id belongs to the processor and the merge step, not to the tower",
    "pad_token_id": "the text model's",
    "transformers_version": "a version stamp",
}
# config.json key -> VisionConfig field, read when present
READ = {
    "vt_hidden_size": "hidden_size",
    "vt_num_hidden_layers": "num_hidden_layers",
    "vt_num_attention_heads": "num_attention_heads",
    "vt_intermediate_size": "intermediate_size",
    "text_hidden_size": "text_hidden_size",
    "qkv_hidden_size": "qkv_hidden_size",
    "patch_size": "patch_size",
    "init_pos_emb_height": "pos_emb_height",
    "init_pos_emb_width": "pos_emb_width",
    "init_pos_emb_time": "pos_emb_time",
    "attn_bias": "attn_bias",
    "linear_bias": "linear_bias",
    "patch_embed_proj_bias": "patch_embed_bias",
    "pos_emb_interpolation_mode": "pos_emb_interpolation",
    "projector_ln_eps": "projector_ln_eps",
}
REQUIRED = ("vt_hidden_size", "vt_num_hidden_layers", "vt_num_attention_heads", "vt_intermediate_size")


def vision_from_hf(raw: dict[str, Any], text_hidden_size: int) -> VisionConfig:
    """The VisionConfig of a config.json `vision_config` (module docstring); `text_hidden_size` is the text model's width,
    which the projector's output must match."""
    unknown = sorted(set(raw) - set(FIXED) - set(IGNORED) - set(READ) - {"merge_kernel_size", "norm_type", "mm_projector_type", "mm_hidden_size"})
    if unknown:
        raise ValueError(f"config.json vision_config key {unknown[0]!r} not understood (known: {sorted(set(FIXED) | set(READ) | set(IGNORED))})")
    for key, value in FIXED.items():
        if key in raw and raw[key] != value:
            raise ValueError(f"config.json vision_config {key}={raw[key]!r} is not supported: the MoonViT3d reference implements {value!r} only")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise ValueError(f"config.json vision_config is missing the field {missing[0]!r}")
    fields: dict[str, Any] = {READ[k]: v for k, v in raw.items() if k in READ}
    fields.setdefault("text_hidden_size", text_hidden_size)
    if fields["text_hidden_size"] != text_hidden_size:
        got = fields["text_hidden_size"]
        raise ValueError(f"config.json vision_config text_hidden_size={got} differs from the text model's hidden_size={text_hidden_size}")
    if raw.get("mm_hidden_size", raw["vt_hidden_size"]) != raw["vt_hidden_size"]:
        raise ValueError(f"config.json vision_config mm_hidden_size={raw['mm_hidden_size']} differs from vt_hidden_size={raw['vt_hidden_size']}")
    if "merge_kernel_size" in raw:
        fields["merge_kernel_size"] = tuple(raw["merge_kernel_size"])
    norm, projector = raw.get("norm_type", "layernorm"), raw.get("mm_projector_type", "patchmerger")
    if norm not in {n.value for n in VisionNorm}:
        raise ValueError(f"config.json vision_config norm_type={norm!r} is not supported: expected one of {[n.value for n in VisionNorm]}")
    if projector not in {p.value for p in Projector}:
        raise ValueError(f"config.json vision_config mm_projector_type={projector!r} is not supported: expected one of {[p.value for p in Projector]}")
    return VisionConfig(**fields, norm=VisionNorm(norm), projector=Projector(projector))


def vision_to_hf(v: VisionConfig) -> dict[str, Any]:
    """The `vision_config` that vision_from_hf reads back to an equal VisionConfig (the release's key names)."""
    out: dict[str, Any] = {"model_type": "moonvit3d", "pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool", "mlp_type": "mlp2"}
    out |= {key: getattr(v, name) for key, name in READ.items()}
    out |= {"merge_kernel_size": list(v.merge_kernel_size), "norm_type": v.norm.value, "mm_projector_type": v.projector.value, "mm_hidden_size": v.hidden_size}
    return out

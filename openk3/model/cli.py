"""`openk3 quantize SRC DST`: convert a full-precision checkpoint to K3's layout (routed experts packed MXFP4, the rest as is)."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch

# files besides the weights that a model folder carries and the converted folder should keep
# what a folder keeps beside its weights: both tokenizer formats (tokenizer.json; Kimi's tiktoken.model with its code), the
# chat template when it is a file of its own, generation defaults and the card
SIDECAR_FILES = (
    "tokenizer.json",
    "tiktoken.model",
    "tokenization_kimi.py",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
    "MODEL_CARD.md",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("quantize", help="pack a checkpoint's routed experts as MXFP4 (K3 compressed-tensors layout)")
    p.add_argument("src", type=Path, help="model folder with config.json and safetensors weights")
    p.add_argument("dst", type=Path, help="output folder (created)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="dtype of the non-expert weights")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from openk3.model.weights import load_model, save_model

    model = load_model(args.src, dtype=getattr(torch, args.dtype))
    model.quantize_experts()
    save_model(model, args.dst)
    for name in SIDECAR_FILES:
        if (args.src / name).exists():
            shutil.copy2(args.src / name, args.dst / name)
    packed = sum(moe.experts.bank().nbytes for moe in model.moe_layers())  # type: ignore[attr-defined]
    print(f"wrote {args.dst}: routed experts packed as MXFP4, {packed / 2**20:.1f} MiB")
    return 0

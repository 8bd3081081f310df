"""`openk3 train-mtp`: learn a multi-token-prediction draft layer for a trained model folder (train/mtp_head.py), ship it
in the folder as a shard of its own under the release's MTP names, and measure its acceptance on held-out text.

The layer is self-distilled on windows of the corpus's training split (every 50th KJV chapter is held out, as for the
demo model), written to FOLDER/model-mtp.safetensors as `model.layers.{num_hidden_layers}.*` (DeepSeek-V3's and the K3
release's numbering: the loaders skip it for the text model, model/mtp_load.py reads it for method "mtp"; float weights
in bf16 as the demo trunk, routers in fp32, the routed experts packed MXFP4 as the target's are), and the folder's
model.safetensors.index.json is regenerated over all its shards (model/shard_index.py). The acceptance is then measured
with the layer read back from the folder: greedy decoding of each held-out chapter's opening through the engine, with and
without speculation, the outputs checked equal.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

MTP_SHARD = "model-mtp.safetensors"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train-mtp", help="learn an MTP draft layer for a model folder, ship it there, measure its acceptance")
    p.add_argument("folder", type=Path, help="trained model folder (config.json, model.safetensors, tokenizer); the layer is written here")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--windows", type=int, default=256, help="training windows drawn from the corpus's training split")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32, help="held-out evaluation: each chapter's first tokens as the prompt")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--k", type=int, nargs="+", default=[2, 3], help="draft tokens per step to measure")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=run)


def kjv_windows(folder: Path, count: int, seq_len: int, seed: int) -> tuple[torch.Tensor, list[list[int]]]:
    """`count` random windows [count, seq_len] of the KJV training split, and the held-out chapters' token ids, with the
    folder's tokenizer (as `openk3 train` encoded them: each chapter followed by `<|eos|>`)."""
    from openk3.train.data import encode_documents, kjv_chapters, split_documents
    from openk3.train.tokenizer import EOS, load_trained_tokenizer

    tok = load_trained_tokenizer(folder)
    train_docs, held_docs = split_documents(kjv_chapters())
    stream = encode_documents(tok, train_docs, tok.token_to_id(EOS))
    starts = torch.randint(0, stream.numel() - seq_len, (count,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()]), [enc.ids for enc in tok.encode_batch(held_docs)]


def export_mtp(layer, index: int) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The layer's tensors under the release's names: `model.layers.{index}.*`, the routed experts split per expert; float
    weights bf16 except the router's (fp32, as the checkpoint keeps them)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in layer.state_dict().items():
        full = f"model.layers.{index}.{name}"
        m = re.match(r"^(.*\.block_sparse_moe\.experts)\.(w[123])(_weight_packed|_weight_scale)?$", full)
        if m:
            suffix = (m.group(3) or "_weight")[1:]
            for e in range(tensor.shape[0]):
                out[f"{m.group(1)}.{e}.{m.group(2)}.{suffix}"] = tensor[e].contiguous()
            continue
        router = ".block_sparse_moe.gate." in full
        out[full] = tensor.contiguous() if router or not tensor.is_floating_point() else tensor.to(torch.bfloat16).contiguous()
    return out


def acceptance(folder: Path, held: list[list[int]], prompt_tokens: int, new_tokens: int, k: int) -> dict:
    """Held-out acceptance with the layer read back from `folder` as the draft (train/draft_acceptance.py)."""
    from openk3.model.mtp_load import load_mtp
    from openk3.serve.loading import build_model
    from openk3.train.draft_acceptance import held_out_acceptance

    target, tokenizer = build_model(folder, torch.float32, "cpu", 0, mtp=True)
    layer = load_mtp(folder, target)  # type: ignore[arg-type]
    return held_out_acceptance(target, tokenizer, held, prompt_tokens, new_tokens, k, mtp_layer=layer)


def run(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    from openk3.model.shard_index import write_index
    from openk3.serve.loading import build_model
    from openk3.train.mtp_head import new_mtp_layer, train_mtp

    torch.set_num_threads(args.threads)
    target, _ = build_model(args.folder, torch.float32, "cpu", args.seed, mtp=True)
    data, held = kjv_windows(args.folder, args.windows, args.seq_len, args.seed)
    layer = new_mtp_layer(target, args.seed)  # type: ignore[arg-type]
    losses = train_mtp(target, layer, data, args.steps, seed=args.seed)  # type: ignore[arg-type]
    save_file(export_mtp(layer, target.config.num_hidden_layers), str(args.folder / MTP_SHARD), metadata={"format": "pt"})
    index = write_index(args.folder)
    summary = {
        "steps": args.steps,
        "windows": f"{args.windows} x {args.seq_len} tokens of the KJV training split",
        "loss_first_10": round(sum(losses[:10]) / 10, 4),
        "loss_last_10": round(sum(losses[-10:]) / 10, 4),
        "held_out": [acceptance(args.folder, held, args.prompt_tokens, args.new_tokens, k) for k in args.k],
    }
    print(f"wrote {args.folder / MTP_SHARD} and {index}")
    print(json.dumps(summary, indent=2))
    return 0

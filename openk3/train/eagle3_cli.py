"""`openk3 train-eagle3`: learn an EAGLE-3 draft head for a trained model folder (train/eagle3_head.py), write it as an
EAGLE-3 head folder in the published format, and measure its acceptance on held-out text.

The head is self-distilled with the training-time test on windows of the corpus's training split (every 50th KJV chapter
is held out, as for the demo model; train-mtp's windows), and written to OUT (default FOLDER/eagle3): config.json with
`architectures: ["LlamaForCausalLMEagle3"]`, the Llama fields, `draft_vocab_size` and `eagle_config.
eagle_aux_hidden_state_layer_ids`, and model.safetensors with `fc`, `midlayer.*`, `norm`, `lm_head` (bf16), `d2t`, `t2d` --
what model/eagle3_load.py, vLLM and SGLang read. The acceptance is then measured with the head read back from OUT: greedy
decoding of each held-out chapter's opening through the engine, with and without speculation, the outputs checked equal.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

HEAD_FOLDER = "eagle3"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train-eagle3", help="learn an EAGLE-3 draft head for a model folder, write it in the EAGLE-3 format, measure its acceptance")
    p.add_argument("folder", type=Path, help="trained model folder (config.json, model.safetensors, tokenizer)")
    p.add_argument("--out", type=Path, default=None, help=f"the head's folder (default FOLDER/{HEAD_FOLDER})")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test steps (the head fed its own output for the later ones)")
    p.add_argument("--draft-vocab", type=int, default=1024, help="draft vocabulary: the most frequent tokens of the training windows")
    p.add_argument("--windows", type=int, default=256, help="training windows drawn from the corpus's training split")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32, help="held-out evaluation: each chapter's first tokens as the prompt")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--k", type=int, nargs="+", default=[2, 3], help="draft tokens per step to measure")
    p.add_argument("--layer", choices=["llama", "mla"], default="llama", help="the draft layer: Llama GQA, or K3's NoPE gated MLA (the K3 drafts' layout)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.set_defaults(func=run)


def head_config_json(head) -> dict:  # type: ignore[no-untyped-def]
    """config.json of the head, as EAGLE-3 trainers write it."""
    c = head.config
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "tie_word_embeddings": False,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids), "use_aux_hidden_state": True},
    }


def mla_head_config_json(head) -> dict:  # type: ignore[no-untyped-def]
    """config.json of a K3 MLA head, in TorchSpec's Kimi-K3 draft layout (model/eagle3_mla_load.py reads it)."""
    c = head.config
    m = c.mla
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "torch_dtype": "bfloat16",
        "hidden_act": c.activation.value,
        "activation_situ_beta": c.situ_beta,
        "activation_situ_linear_beta": c.situ_linear_beta,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": m.num_heads,
        "num_key_value_heads": m.num_heads,
        "q_lora_rank": m.q_lora_rank,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": m.output_gate,
        "fc_norm": c.fc_norm,
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids), "use_aux_hidden_state": True},
    }


def export_eagle3(head, out: Path) -> None:  # type: ignore[no-untyped-def]
    """The head folder: config.json and model.safetensors (float weights bf16; d2t int64, t2d bool)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: (t.to(torch.bfloat16) if t.is_floating_point() else t).contiguous() for n, t in head.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    from openk3.model.eagle3_mla import Eagle3MLAHead

    config = mla_head_config_json(head) if isinstance(head, Eagle3MLAHead) else head_config_json(head)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def acceptance(folder: Path, head_dir: Path, held: list[list[int]], prompt_tokens: int, new_tokens: int, k: int) -> dict:
    """Held-out acceptance with the head read back from `head_dir` as the draft (train/draft_acceptance.py)."""
    from openk3.model.eagle3_mla_load import load_any_eagle3
    from openk3.serve.loading import build_model
    from openk3.train.draft_acceptance import held_out_acceptance

    target, tokenizer = build_model(folder, torch.float32, "cpu", 0)
    head = load_any_eagle3(head_dir, target)  # type: ignore[arg-type]
    return held_out_acceptance(target, tokenizer, held, prompt_tokens, new_tokens, k, eagle3_head=head)


def run(args: argparse.Namespace) -> int:
    from openk3.serve.loading import build_model
    from openk3.train.eagle3_head import draft_vocabulary, new_eagle3_head, train_eagle3
    from openk3.train.eagle3_mla_train import new_eagle3_mla_head
    from openk3.train.mtp_cli import kjv_windows

    torch.set_num_threads(args.threads)
    out = args.out or args.folder / HEAD_FOLDER
    target, _ = build_model(args.folder, torch.float32, "cpu", args.seed)
    data, held = kjv_windows(args.folder, args.windows, args.seq_len, args.seed)
    draft_ids = draft_vocabulary(data, target.config.vocab_size, min(args.draft_vocab, target.config.vocab_size))
    new = new_eagle3_mla_head if args.layer == "mla" else new_eagle3_head
    head = new(target, draft_ids, seed=args.seed)  # type: ignore[arg-type]
    losses = train_eagle3(target, head, data, args.steps, args.ttt_steps, seed=args.seed)  # type: ignore[arg-type]
    export_eagle3(head, out)
    size = sum(f.stat().st_size for f in out.iterdir())
    summary = {
        "layer": args.layer,
        "steps": args.steps,
        "ttt_steps": args.ttt_steps,
        "windows": f"{args.windows} x {args.seq_len} tokens of the KJV training split",
        "draft_vocab": len(draft_ids),
        "head_bytes": size,
        "loss_first_10": round(sum(losses[:10]) / 10, 4),
        "loss_last_10": round(sum(losses[-10:]) / 10, 4),
        "held_out": [acceptance(args.folder, out, held, args.prompt_tokens, args.new_tokens, k) for k in args.k],
    }
    print(f"wrote {out}")
    print(json.dumps(summary, indent=2))
    return 0

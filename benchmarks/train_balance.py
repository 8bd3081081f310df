"""Expert load balance during training: Quantile Balancing vs the DeepSeek-V3 sign update vs no balancing, same seed and data.

Each method trains the same model from the same initialisation on the same KJV batches; the table gives max/mean expert load
(1.0 = perfectly balanced, n/k = one expert takes every slot) per MoE layer, averaged over steps after the warm-in, plus the
mean over the last 10 steps and the final training loss (balancing should not cost loss).

  python benchmarks/train_balance.py                                  # debug model, 60 steps (about a minute on 2 busy cores)
  python benchmarks/train_balance.py --config tiny --steps 40 --seq-len 128
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import time

import torch

from openk3.config import preset
from openk3.train.balance import BalanceConfig, BalanceMethod
from openk3.train.data import TokenWindows, encode_documents, eval_windows, kjv_chapters, split_documents
from openk3.train.tokenizer import EOS, train_tokenizer
from openk3.train.trainer import TrainConfig, Trainer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="debug")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--sign-rate", type=float, default=1e-3, help="DeepSeek-V3's u (their default 1e-3)")
    p.add_argument("--warm-in", type=int, default=10, help="steps excluded from the average")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)

    train_docs, held_docs = split_documents(kjv_chapters())
    tok = train_tokenizer(train_docs, 4096)
    eos = tok.token_to_id(EOS)
    train_ids, held_ids = encode_documents(tok, train_docs, eos), encode_documents(tok, held_docs, eos)
    model_config = preset(args.config).replace(vocab_size=tok.get_vocab_size())

    methods = {
        "qb": BalanceConfig(method=BalanceMethod.QUANTILE),
        "sign": BalanceConfig(method=BalanceMethod.SIGN, sign_rate=args.sign_rate),
        "none": BalanceConfig(method=BalanceMethod.NONE),
    }
    logs, seconds = {}, {}
    for name, balance in methods.items():
        cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
                          warmup_steps=min(20, args.steps // 5), eval_every=args.steps, eval_windows=8, checkpoint_every=args.steps,
                          balance=balance)  # fmt: skip
        trainer = Trainer(model_config, cfg, TokenWindows(train_ids, args.seq_len, args.seed), eval_windows(held_ids, args.seq_len, 8), None)
        t0 = time.perf_counter()
        logs[name] = trainer.fit(progress=False)
        seconds[name] = time.perf_counter() - t0

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread(s); commit {commit}")
    print(f"model {args.config}, {args.steps} steps of {args.batch_size}x{args.seq_len} KJV tokens, seed {args.seed}, sign rate {args.sign_rate}\n")
    layers = list(logs["qb"][0]["load_max_over_mean"])
    spans = [f"{m} (steps {args.warm_in + 1}-{args.steps})" for m in methods] + [f"{m} (last 10)" for m in methods]
    print("| MoE layer | " + " | ".join(spans) + " |")
    print("|" + "---|" * (1 + 2 * len(methods)))

    def mean(log, layer, start):
        values = [r["load_max_over_mean"][layer] for r in log[start:]]
        return sum(values) / len(values)

    for layer in layers + ["all"]:
        cells = []
        for start in (args.warm_in, args.steps - 10):
            for m in methods:
                if layer == "all":
                    cells.append(f"{sum(mean(logs[m], x, start) for x in layers) / len(layers):.3f}")
                else:
                    cells.append(f"{mean(logs[m], layer, start):.3f}")
        print(f"| {layer} | " + " | ".join(cells) + " |")
    print()
    for m in methods:
        tail = logs[m][-10:]
        print(f"{m}: final train loss (mean of last 10 steps) {sum(r['loss'] for r in tail) / len(tail):.4f}, "
              f"held-out {logs[m][-1]['held_out_loss']:.4f}, {seconds[m]:.0f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

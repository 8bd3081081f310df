"""`openk3 distill score | train | on-policy`: teachers score a corpus into a store, a student learns from the store, and a
student continues on its own samples with the teachers scoring them (docs/distillation.md).

Teachers are model folders (what `openk3 train` exports, or any checkpoint openk3 serves) with their tokenizer; every teacher
and the student must share it (compared id by id). Domains are the offline corpora of train/data.py (`kjv`, `python`).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch

from openk3.train.data import DOMAINS


def _pairs(items: list[str], flag: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise SystemExit(f"{flag} {item!r}: expected KEY=VALUE")
        if key in out:
            raise SystemExit(f"{flag} names {key!r} twice")
        out[key] = value
    return out


def _teacher_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--teacher", action="append", default=[], metavar="NAME=MODEL_DIR", help="a teacher (repeat for several)")
    p.add_argument("--route", action="append", default=[], metavar="DOMAIN=NAME", help="which teacher scores a domain (repeat)")
    p.add_argument("--reasoning-teacher", default=None, metavar="NAME", help="the teacher of the thinking segments")
    p.add_argument("--think-markers", choices=("k2", "k3"), default="k2", help="k2: <think>...</think>; k3: <|open|>think<|sep|>...")
    p.add_argument("--k", type=int, default=16, help="teacher top-k stored per position")
    p.add_argument("--max-num-seqs", type=int, default=64, help="the teacher engines' batch")


def _student_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="student preset (tiny, debug); the vocabulary is the tokenizer's")
    p.add_argument("--width", type=int, default=None, help="instead of --config: the 4-layer model of this width (the demo's)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-windows", type=int, default=32, help="held-out windows per domain for the final perplexities")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, required=True, help="run folder: checkpoint.pt, log.jsonl, model/, summary.json")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.pt")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("distill", help="distil domain teachers into one student (off-policy from a store, or on-policy)")
    sub = p.add_subparsers(dest="distill_command", metavar="STEP", required=True)
    s = sub.add_parser("score", help="the teachers score windows of each domain's training split into a top-k store")
    _teacher_args(s)
    s.add_argument("--windows", type=int, default=512, help="windows per domain")
    s.add_argument("--seq-len", type=int, default=64)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--store", type=Path, required=True, help="an empty folder for the store (and a copy of the tokenizer)")
    s.set_defaults(func=run_score)
    t = sub.add_parser("train", help="train a student on a store: KL to the teachers mixed with the next-token loss")
    t.add_argument("--store", type=Path, required=True)
    t.add_argument("--kl", choices=("forward", "reverse"), default="forward", help="forward: KL(teacher||student)")
    t.add_argument("--topk", choices=("tail", "renorm"), default="tail", help="top-k form: a tail bucket, or renormalised")
    t.add_argument("--kl-weight", type=float, default=0.5, help="loss = w KL + (1 - w) next-token cross-entropy")
    _student_args(t)
    t.set_defaults(func=run_train)
    o = sub.add_parser("on-policy", help="the student samples, the teachers score its samples, it minimises the reverse KL")
    _teacher_args(o)
    _student_args(o)
    o.add_argument("--tokenizer", type=Path, required=True, help="the shared tokenizer folder (a store's, or a teacher's)")
    o.add_argument("--init", type=Path, default=None, help="start from this checkpoint.pt (a `distill train` run)")
    o.add_argument("--prompt-len", type=int, default=16)
    o.add_argument("--sample-len", type=int, default=32)
    o.add_argument("--temperature", type=float, default=1.0)
    o.set_defaults(func=run_on_policy)


def width_config(width: int, vocab: int):
    """A 4-layer K3-architecture model (KDA x3 + MLA, latent MoE of 8 experts top-2, AttnRes) whose sizes follow `width`."""
    from openk3.config import debug
    from openk3.config.model import KDAConfig, MLAConfig, MoEConfig

    if width < 16 or width % 8:
        raise ValueError(f"width={width} is invalid: expected a multiple of 8, >= 16")
    base = debug()
    kda = KDAConfig(num_heads=2, head_dim=width // 4, conv_kernel=4, gate=base.kda.gate, gate_lower_bound=-5.0, full_rank_output_gate=True)
    mla = MLAConfig(
        num_heads=2, q_lora_rank=width // 2, kv_lora_rank=width // 4, qk_nope_head_dim=width // 8, qk_rope_head_dim=8, v_head_dim=width // 8, output_gate=True
    )
    moe = MoEConfig(num_experts=8, num_experts_per_token=2, moe_intermediate_size=width // 2, num_shared_experts=1, latent_size=width // 2, latent_norm=True)
    return base.replace(
        name=f"w{width}", vocab_size=vocab, hidden_size=width, num_hidden_layers=4, mla_layers=(3,), kda=kda, mla=mla, moe=moe, intermediate_size=2 * width
    )


def _student_config(args: argparse.Namespace, vocab: int):
    from openk3.config import preset

    if (args.config is None) == (args.width is None):
        raise SystemExit("give the student's size by exactly one of --config PRESET and --width N")
    return width_config(args.width, vocab) if args.width else preset(args.config).replace(vocab_size=vocab)


def _routing(args: argparse.Namespace, tokenizer):
    from openk3.train.teachers import K2_THINK, K3_THINK, TeacherRouting, ThinkingMarkers

    routes = _pairs(args.route, "--route")
    unknown = sorted(set(routes) - set(DOMAINS))
    if unknown:
        raise SystemExit(f"--route names domains {unknown}; the corpora are {list(DOMAINS)}")
    markers = None
    if args.reasoning_teacher is not None:
        markers = ThinkingMarkers.encode(tokenizer, K3_THINK if args.think_markers == "k3" else K2_THINK)
    return TeacherRouting(routes, args.reasoning_teacher, markers)


def _teachers(args: argparse.Namespace, max_model_len: int) -> dict:
    from openk3.llm import LLM

    paths = _pairs(args.teacher, "--teacher")
    if not paths:
        raise SystemExit("name at least one --teacher NAME=MODEL_DIR")
    return {name: LLM(path, max_num_seqs=args.max_num_seqs, max_model_len=max_model_len) for name, path in paths.items()}


def _encoded(tokenizer, name: str, held_out: bool) -> torch.Tensor:
    """A domain's training or held-out token stream, documents joined by the tokenizer's eos."""
    from openk3.train.data import domain_documents

    docs = domain_documents(name)[1 if held_out else 0]
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for d in docs:
        ids += tokenizer.encode(d) + ([eos] if eos is not None else [])
    return torch.tensor(ids, dtype=torch.int64)


def run_score(args: argparse.Namespace) -> int:
    from openk3.train.data import TokenWindows
    from openk3.train.teacher_store import StoreLayout, StoreWriter
    from openk3.train.teachers import check_same_tokenizer, score_routed

    teachers = _teachers(args, args.seq_len + 8)
    first = next(iter(teachers.values()))
    fingerprint = check_same_tokenizer({n: e.tokenizer for n, e in teachers.items()})
    routing = _routing(args, first.tokenizer)
    routing.check_teachers(list(teachers))
    domains = list(routing.domains)
    writer = StoreWriter(args.store, StoreLayout(args.k, args.seq_len, fingerprint, tuple(domains), routing.teachers()))
    model_dir = Path(_pairs(args.teacher, "--teacher")[next(iter(teachers))])
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / f).is_file():
            (args.store / "tokenizer").mkdir(exist_ok=True)
            shutil.copy2(model_dir / f, args.store / "tokenizer" / f)
    for i, d in enumerate(domains):
        windows = TokenWindows(_encoded(first.tokenizer, d, held_out=False), args.seq_len, args.seed + i).next_batch(args.windows)
        for a in range(0, args.windows, args.max_num_seqs):
            writer.add(score_routed(teachers, routing, windows[a : a + args.max_num_seqs], [d] * len(windows[a : a + args.max_num_seqs]), args.k, domains))
        print(f"{d}: {args.windows} windows of {args.seq_len} positions scored by {routing.teacher_of(d)}")
    layout = writer.close()
    print(f"store {args.store}: {layout.num_windows} windows in {len(layout.shards)} shards, k={layout.k}")
    return 0


def _finish(trainer, tokenizer_dir: Path, out: Path, held: dict[str, torch.Tensor]) -> dict:
    """Checkpoint, the model folder (dense fp32 experts: no QAT ran, so MXFP4 packing is left to `openk3 quantize`), summary."""
    from openk3.model.weights import save_model
    from openk3.train.trainer import evaluate

    trainer.save_checkpoint()
    trainer.model.eval()
    save_model(trainer.model, out / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, out / "model" / name)
    summary = {"steps": trainer.step} | {f"held_out_ppl_{d}": round(math.exp(evaluate(trainer.model, w)), 3) for d, w in held.items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


def _train_config(args: argparse.Namespace, seq_len: int):
    from openk3.train.trainer import TrainConfig

    return TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=seq_len, lr=args.lr, warmup_steps=args.warmup, seed=args.seed, eval_every=10**9)


def run_train(args: argparse.Namespace) -> int:
    from openk3.serve.tokenizer import HFTokenizer
    from openk3.train.data import eval_windows
    from openk3.train.distill import DistillConfig, DistillTrainer
    from openk3.train.distill_loss import Direction, TopK
    from openk3.train.teacher_store import TeacherStream, read_layout
    from openk3.train.teachers import tokenizer_fingerprint

    torch.set_num_threads(args.threads)
    layout = read_layout(args.store)
    tok_dir = args.store / "tokenizer"
    tokenizer = HFTokenizer(tok_dir)
    if tokenizer_fingerprint(tokenizer) != layout.tokenizer:
        raise SystemExit(f"{tok_dir} is not the tokenizer the store was scored with (fingerprint {layout.tokenizer})")
    config = _student_config(args, tokenizer.vocab_size)
    held = {d: eval_windows(_encoded(tokenizer, d, held_out=True), layout.seq_len, args.eval_windows) for d in layout.domains}
    distill = DistillConfig(Direction(args.kl), TopK(args.topk), args.kl_weight)
    trainer = DistillTrainer(config, _train_config(args, layout.seq_len), distill, TeacherStream(args.store, args.seed), held[layout.domains[0]], args.out)
    if args.resume and trainer.resume():
        print(f"resumed {args.out / 'checkpoint.pt'} at step {trainer.step}")
    trainer.fit()
    _finish(trainer, tok_dir, args.out, held)
    return 0


def run_on_policy(args: argparse.Namespace) -> int:
    from openk3.serve.tokenizer import HFTokenizer
    from openk3.train.data import eval_windows
    from openk3.train.on_policy import DomainPrompts, OnPolicyConfig, OnPolicyTrainer

    torch.set_num_threads(args.threads)
    tokenizer = HFTokenizer(args.tokenizer)
    seq_len = args.prompt_len + args.sample_len - 1
    teachers = _teachers(args, seq_len + 8)
    routing = _routing(args, tokenizer)
    config = _student_config(args, tokenizer.vocab_size)
    held = {d: eval_windows(_encoded(tokenizer, d, held_out=True), seq_len, args.eval_windows) for d in routing.domains}
    cfg = OnPolicyConfig(prompt_len=args.prompt_len, sample_len=args.sample_len, k=args.k, temperature=args.temperature)
    prompts = DomainPrompts({d: _encoded(tokenizer, d, held_out=False) for d in routing.domains}, args.prompt_len, args.seed)
    trainer = OnPolicyTrainer(config, _train_config(args, seq_len), cfg, prompts, teachers, routing, tokenizer, next(iter(held.values())), args.out)
    if args.resume and trainer.resume():
        print(f"resumed {args.out / 'checkpoint.pt'} at step {trainer.step}")
    elif args.init is not None:
        trainer.model.load_state_dict(torch.load(args.init, weights_only=False)["model"])
        trainer.after_step()  # the engine samples with the initial weights
    trainer.fit()
    _finish(trainer, args.tokenizer, args.out, held)
    trainer.close()
    return 0

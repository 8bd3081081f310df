"""GRPO on the embedded demo model (`LLM("tiny")`, 12.75M parameters, trained on the King James Bible): it learns to say
the word its prompt names, by reinforcement alone.

Task: a prompt such as "And he said, Say Moses" names one of eight KJV words (LORD, God, Israel, king, people, house,
land, son) as its last word; the reply is one token drawn from those eight words' tokens (SamplingParams.allowed_token_ids,
so a policy that ignores the prompt scores 1 in 8, which is where the demo model starts). Reward 1.0 when the reply is the
named word, else 0.0, checked in process. Two prompt templates are trained on; a third is never trained on and measures
whether what is learnt is "say the named word" rather than sixteen memorised prompts.

Each step: every training prompt is a GRPO group of G samples, sampled through the rollout runner's engine path
(openk3/rl/policy.py LLMPolicy: token ids in, token ids, sampling logprobs and routed experts out) and recorded as the
runner records a turn (rl/episode.py Branch / take_reply, routing stitched as in an episode); group-relative advantages;
one clipped policy-gradient step (openk3/rl/grpo.py) of the trainer's copy with the engine's routing replayed (R3); the
trained tensors pushed into the engine in place (openk3/rl/weight_sync.py update_weights: weight version +1, prefix cache
rekeyed). Trained subset (stated, `--subset`): `head` is `lm_head.weight` and the final norm `model.norm.weight` (1.05M of
12.75M parameters); `head-mixer` adds the output Attention Residual's query and norm (512 parameters). Everything else is
frozen (the MXFP4 experts are used as served); the backward never enters a decoder layer, and runs the differentiable
kernels (OpTarget(training=True)). Correctness gate: before each step the trainer's logprobs of the sampled tokens must
equal the engine's to 1e-3, else the run stops with FAIL.

  python benchmarks/grpo_tiny.py --steps 60 --every 5 --lr 3e-3 --group 16 --threads 1
"""

from __future__ import annotations

import argparse
import platform
import random
import subprocess
import sys
import time

import torch

from openk3.llm import LLM
from openk3.model import K3ForCausalLM, load_model
from openk3.ops.registry import OpTarget
from openk3.rl.episode import Branch, take_reply
from openk3.rl.grpo import GRPOConfig, group_advantages, grpo_step
from openk3.rl.policy import Context, LLMPolicy
from openk3.rl.trajectory import Trajectory, stitch_routing
from openk3.rl.weight_sync import update_weights
from openk3.serve.loading import resolve_model
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import Tokenizer

WORDS = ("LORD", "God", "Israel", "king", "people", "house", "land", "son")
TRAIN_TEMPLATES = ("And he said, Say {w}", "Write the word {w}")
HELD_OUT_TEMPLATE = "The word was {w}"
SUBSETS = {  # what the trainer trains (and pushes); everything else stays as served
    "head": ("lm_head.weight", "model.norm.weight"),
    # + the output Attention Residual's query and norm: how the final hidden state mixes the blocks' outputs (the
    # embeddings' block included), a 512-parameter choice the backward reaches without entering a layer
    "head-mixer": ("lm_head.weight", "model.norm.weight", "model.output_attn_res_proj.weight", "model.output_attn_res_norm.weight"),
}


def word_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """Each word's token, as it follows a space; a word that is not one token is an error (the tokenizer changed)."""
    out = {}
    for w in WORDS:
        ids = tokenizer.encode(" " + w)
        if len(ids) != 1:
            raise ValueError(f"' {w}' is {len(ids)} tokens {ids} in this tokenizer; the task needs one token per word")
        out[w] = ids[0]
    return out


def prompts(templates: tuple[str, ...]) -> list[tuple[str, str]]:
    """(prompt text, the word it names) for every template and word."""
    return [(t.format(w=w), w) for t in templates for w in WORDS]


def rollout(policy: LLMPolicy, tokens: dict[str, int], batch: list[tuple[str, str]], group: int) -> tuple[list[Trajectory], list[float]]:
    """Every prompt's group sampled in one call; the trajectories as the episode runner records them, and advantages."""
    tok = policy.tokenizer
    branches, words = [], []
    for text, word in batch:
        ids = tok.encode(text, add_special_tokens=True)
        for i in range(group):
            branches.append(Branch(i, "", list(ids), [False] * len(ids), [None] * len(ids)))
            words.append(word)
    version = policy.weight_version
    replies = policy.reply([Context(b.index, b.token_ids) for b in branches], 0)
    out, advantages = [], []
    for start in range(0, len(branches), group):
        rewards = []
        for b, reply, word in zip(branches[start : start + group], replies[start : start + group], words[start : start + group], strict=True):
            if take_reply(b, reply, tok) is not None:
                raise AssertionError("a one-token reply cannot call a tool")
            r = 1.0 if reply.token_ids == (tokens[word],) else 0.0
            rewards.append(r)
            routing = stitch_routing(b.routing)
            out.append(Trajectory(word, b.index, tuple(b.token_ids), tuple(b.loss_mask), tuple(b.logprobs), tuple(b.turns), r, version, routing))
        advantages += group_advantages(rewards, GRPOConfig().adv_eps)
    return out, advantages


def greedy_answers(llm: LLM, tokens: dict[str, int], batch: list[tuple[str, str]]) -> list[str]:
    """The word the policy answers each prompt with at temperature 0."""
    params = SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=tuple(tokens.values()))
    outs = llm.generate([llm.tokenizer.encode(t, add_special_tokens=True) for t, _ in batch], params)
    word_of = {i: w for w, i in tokens.items()}
    return [word_of[o.outputs[0].token_ids[0]] for o in outs]


def greedy_accuracy(llm: LLM, tokens: dict[str, int], batch: list[tuple[str, str]]) -> float:
    return sum(a == w for a, (_, w) in zip(greedy_answers(llm, tokens, batch), batch, strict=True)) / len(batch)


def trainer_model(seed: int, trained: tuple[str, ...]) -> K3ForCausalLM:
    """The trainer's copy of the served checkpoint, fp32, with only `trained` left trainable."""
    torch.manual_seed(seed)
    path = resolve_model("tiny")
    if path is None:
        raise ValueError("the tiny preset has no shipped checkpoint here")
    model = load_model(path)
    names = dict(model.named_parameters())
    missing = [n for n in trained if n not in names]
    if missing:
        raise ValueError(f"the tiny checkpoint has no {missing}")
    for name, p in names.items():
        p.requires_grad_(name in trained)
    model.select_ops(target=OpTarget(training=True))  # differentiable kernels: autograd runs through the final norm
    return model.eval()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--subset", choices=sorted(SUBSETS), default="head", help="the parameters trained (SUBSETS)")
    p.add_argument("--every", type=int, default=3, help="print a row every this many steps")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    train, held_out = prompts(TRAIN_TEMPLATES), prompts((HELD_OUT_TEMPLATE,))
    llm = LLM("tiny", max_model_len=64, max_num_seqs=len(train) * args.group, seed=args.seed)
    tokens = word_tokens(llm.tokenizer)
    trained = SUBSETS[args.subset]
    trainer = trainer_model(args.seed, trained)
    params = [p for p in trainer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    policy = LLMPolicy(llm, SamplingParams(temperature=1.0, max_tokens=1, allowed_token_ids=tuple(tokens.values())), return_routing=True)
    cfg = GRPOConfig()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    total = sum(p.numel() for p in trainer.parameters())
    print(f"command: python benchmarks/grpo_tiny.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads; commit {commit}")
    print(
        f"policy: tiny ({total / 1e6:.2f}M parameters besides the packed MXFP4 experts, vocabulary {trainer.config.vocab_size}); trained {', '.join(trained)} "
        f"({sum(p.numel() for p in params) / 1e6:.2f}M); {len(train)} training prompts x {args.group} samples, {len(held_out)} held-out prompts"
    )
    print()
    print("| step | mean reward | greedy acc (train) | greedy acc (held-out template) | rollout s | train s | push s | weight version |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows, totals = [], {"rollout": 0.0, "train": 0.0, "push": 0.0}
    for step in range(args.steps + 1):
        version = llm.engine.weight_version
        t0 = time.perf_counter()
        batch, advantages = rollout(policy, tokens, train, args.group)
        rollout_s = time.perf_counter() - t0
        mean_reward = sum(t.reward for t in batch) / len(batch)
        shown = step % args.every == 0 or step == args.steps
        if shown:  # the policy that sampled this step's batch (weight version `version`)
            acc, acc_held = greedy_accuracy(llm, tokens, train), greedy_accuracy(llm, tokens, held_out)
        train_s = push_s = 0.0
        if step < args.steps:  # the last row only measures the final policy
            t1 = time.perf_counter()
            stats = grpo_step(trainer, optimizer, batch, advantages, cfg)
            t2 = time.perf_counter()
            if not stats.max_logprob_gap <= 1e-3:  # NaN fails too
                print(f"FAIL: trainer and engine logprobs differ by {stats.max_logprob_gap:.2e} at step {step}")
                return 1
            state = trainer.state_dict()
            update_weights(llm, {n: state[n] for n in trained})
            t3 = time.perf_counter()
            train_s, push_s = t2 - t1, t3 - t2
            totals["train"] += train_s
            totals["push"] += push_s
        totals["rollout"] += rollout_s
        rows.append(mean_reward)
        if shown:
            print(f"| {step} | {mean_reward:.3f} | {acc:.2f} | {acc_held:.2f} | {rollout_s:.3f} | {train_s:.3f} | {push_s:.3f} | {version} |")
    answers = greedy_answers(llm, tokens, held_out)
    llm.close()
    print()
    print("held-out template, greedy answers at the end: " + ", ".join(f"{w}->{a}" for (_, w), a in zip(held_out, answers, strict=True)))
    k = min(3, len(rows))
    print()
    print(f"mean reward, first {k} steps {sum(rows[:k]) / k:.3f} -> last {k} steps {sum(rows[-k:]) / k:.3f}")
    steps = max(args.steps, 1)
    print(f"per step: rollout {totals['rollout'] / (args.steps + 1):.3f} s, train {totals['train'] / steps:.3f} s, weight push {totals['push'] / steps:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

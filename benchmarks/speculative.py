"""Speculative decoding on the embedded demo model (issue 39): decode tok/s and acceptance with and without a draft model,
greedy, at batch 1, 4 and 16, the baseline measured in the same run.

Drafts: `self` is the demo model itself (every draft accepted: the acceptance upper bound and the pure overhead of drafting
and verifying); `half` is the demo model's first 4 layers (three KDA layers and one MLA layer, with its embedding, final
norm and head), a layer-skip draft at about half the target's cost; `mtp` is an MTP layer (model/mtp.py: one gated-MLA
MoE layer reading the target's hidden states, method "mtp") that this script first trains by self-distillation
(openk3/train/mtp_head.py) on the demo model's own sampled continuations of other prompts than the ones measured, for
--mtp-steps steps, or loads one (--mtp-layer: a saved state dict, or `shipped` for the layer the demo assets ship,
trained on KJV text by `openk3 train-mtp`); `eagle3` is an EAGLE-3 head (model/eagle3.py, method "eagle3"): --eagle3-head,
a head folder in the EAGLE-3 format, default `shipped` (openk3/assets/tiny/eagle3, trained by `openk3 train-eagle3`).
Correctness gate: every
speculative run's greedy tokens must equal the baseline's token for token; a failing row prints FAIL instead of a ratio.
--forms stepwise chunked adds, in the same run, rows whose verification runs in the chunked prefill form with the
snapshot-and-recompute rollback (the engine's form before per-position KDA states, serve/spec_states.py). --clock cpu
times this process's CPU time instead of elapsed time: with --threads 1 that is the work of one core, which other jobs on
a shared machine do not inflate. --disable-by-batch-size N adds, in the same run, rows with vLLM's key of that name
(SpeculativeConfig.disable_by_batch_size: no drafts in a step that begins with N or more running requests).
--grammar json gives every request (baseline and speculative alike) a JSON schema of one string field, so the output is
`{"text": "..."}` and the string holds what the model writes: drafts are checked against the grammar and cut at the first
it rejects (serve/spec_logits.py); the requests then end when the grammar does (no ignore_eos).

  python benchmarks/speculative.py                       # batch 1, 4, 16; k = 3; 64 new tokens; drafts self, half, mtp
  python benchmarks/speculative.py --batch 1 --k 2 4 --new 32 --drafts mtp
  python benchmarks/speculative.py --batch 1 4 16 --k 2 3 --new 32 --drafts mtp --forms stepwise chunked --threads 1 --clock cpu
  python benchmarks/speculative.py --batch 1 4 16 --k 2 3 --new 32 --drafts mtp --mtp-layer shipped --disable-by-batch-size 8 --threads 1 --clock cpu
  python benchmarks/speculative.py --batch 1 4 --k 2 --new 48 --drafts mtp --mtp-layer shipped --prompts kjv --grammar json --threads 1 --clock cpu
  python benchmarks/speculative.py --batch 1 4 16 --k 2 3 --new 32 --drafts eagle3 mtp --mtp-layer shipped --prompts kjv --threads 1 --clock cpu
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import platform
import subprocess
import time
from typing import Any

import torch

from openk3.model import K3ForCausalLM
from openk3.model.batch import StateCut
from openk3.model.eagle3 import Eagle3Head, Past
from openk3.model.eagle3_load import load_eagle3
from openk3.model.mtp import MTPLayer
from openk3.model.mtp_load import load_mtp
from openk3.parallel.layout import ServingPlan, apply_serving_layout
from openk3.serve import runner as runner_module
from openk3.serve.cache.manager import CacheManager
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.loading import build_model, resolve_model
from openk3.serve.pack import PackedRow, pack
from openk3.serve.sampling import SamplingParams
from openk3.serve.spec_states import stepwise_verification
from openk3.serve.speculative import SpecDecodeStats, SpeculativeConfig
from openk3.serve.structured.compiler import GrammarCompiler
from openk3.serve.structured.spec import Grammar, StructuredOutputs
from openk3.train.data import kjv_chapters, split_documents
from openk3.train.mtp_head import new_mtp_layer, train_mtp


def truncated_draft(target: K3ForCausalLM, n: int) -> K3ForCausalLM:
    """The target's first n layers as a model of its own (a copy: its layers keep their cache indices, which the first
    layers' KDA and MLA layers number from 0 as in a model built with n layers)."""
    cfg = target.config
    draft = copy.deepcopy(target)
    draft.model.layers = draft.model.layers[:n]
    draft.config = dataclasses.replace(cfg, num_hidden_layers=n, mla_layers=tuple(i for i in cfg.mla_layers if i < n))
    for m in draft.modules():
        if m is not draft and getattr(m, "config", None) is cfg:
            setattr(m, "config", draft.config)  # noqa: B010  # the submodules that keep the config read the truncated one
    return draft.eval()


TRAIN_STARTS = ["Tom and", "The cat", "One day a", "There was a little", "Lily wanted to", "The big dog", "Mom said", "A bird", "Ben had a"]


def mtp_draft(target: K3ForCausalLM, tokenizer, steps: int, length: int = 64) -> tuple[MTPLayer, float, float]:
    """An MTP layer trained on the demo model's sampled continuations of TRAIN_STARTS (4 seeds each), its first and last
    losses (averaged over 10 steps)."""
    n = 4 * len(TRAIN_STARTS)
    engine = LLMEngine(target, tokenizer, EngineConfig(max_num_seqs=n, max_model_len=256, num_pages=n * 8, page_size=16))
    for i, text in enumerate(TRAIN_STARTS * 4):
        engine.add_request(str(i), tokenizer.encode(text), SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True, seed=i))
    seqs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        engine.step()
        for req in engine.scheduler.running:
            seqs[req.request_id] = req.token_ids
    data = torch.tensor([t[:length] for t in seqs.values() if len(t) >= length])
    layer = new_mtp_layer(target)
    losses = train_mtp(target, layer, data, steps)
    apply_serving_layout(layer, ServingPlan(torch.device("cpu")))
    return layer, sum(losses[:10]) / 10, sum(losses[-10:]) / 10


def forward_costs(target: K3ForCausalLM, layer: MTPLayer, k: int) -> str:
    """CPU time on one thread (this process's own, so other jobs' load does not count; with more threads it would count
    their spin-waiting) of one target forward of 1 decode row, of k + 1 verification rows (stepwise, with the per-position
    state cuts the engine takes, and in the chunked prefill form), and of one MTP draft step (1 row and the head), each
    after 100 cached tokens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cache, mcache = CacheManager(target.config, 64, 16, 1, verify_slots=k), CacheManager(layer.config, 64, 16, 1)
    cache.allocate("a", 200)
    mcache.allocate("a", 200)
    cpu, h = torch.device("cpu"), torch.randn(1, target.config.hidden_size)

    def row(c: CacheManager, start: int, ids: list[int]) -> tuple[Any, Any]:
        return pack([PackedRow(c.slot("a"), c.page_ids("a"), start, ids)], cpu), c.tensors

    def ms(fn, n: int = 15) -> float:  # type: ignore[no-untyped-def]
        fn()
        start = time.process_time()
        for _ in range(n):
            fn()
        return (time.process_time() - start) / n * 1000

    with torch.inference_mode():
        target(*row(cache, 0, list(range(10, 110))))
        dec = ms(lambda: target(*row(cache, 100, [5])))
        ver = ms(lambda: target(*row(cache, 100, [5] * (k + 1))))
        cuts = tuple(StateCut(0, offset, slot) for offset, slot in enumerate(cache.verify_slots, start=1))
        step = ms(lambda: target(dataclasses.replace(row(cache, 100, [5] * (k + 1))[0], stepwise=True, state_cuts=cuts), cache.tensors))
        mtp = ms(lambda: layer.compute_logits(layer(*row(mcache, 100, [5]), h)))
    torch.set_num_threads(threads)
    verify = f"target {k + 1} verification rows: stepwise {step:.1f} ({step / dec:.2f}x), chunked {ver:.1f} ({ver / dec:.2f}x)"
    return f"1-thread CPU ms per forward: target 1 decode row {dec:.1f}, {verify}, MTP step {mtp:.1f} ({mtp / dec:.2f}x)"


def eagle3_cost(target: K3ForCausalLM, head: Eagle3Head) -> str:
    """1-thread CPU ms of one EAGLE-3 draft step (1 row over 100 kept positions, and its logits) against one target decode row."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cache = CacheManager(target.config, 64, 16, 1)
    cache.allocate("a", 200)
    cpu, c = torch.device("cpu"), head.config
    keys = torch.randn(100, c.num_key_value_heads, c.head_dim)
    x, ids, pos = torch.randn(1, c.hidden_size), torch.tensor([5]), torch.tensor([100])

    def ms(fn, n: int = 15) -> float:  # type: ignore[no-untyped-def]
        fn()
        start = time.process_time()
        for _ in range(n):
            fn()
        return (time.process_time() - start) / n * 1000

    with torch.inference_mode():
        target(pack([PackedRow(cache.slot("a"), cache.page_ids("a"), 0, list(range(10, 110)))], cpu), cache.tensors)
        dec = ms(lambda: target(pack([PackedRow(cache.slot("a"), cache.page_ids("a"), 100, [5])], cpu), cache.tensors))
        step = ms(lambda: head.compute_logits(head(ids, x, pos, [Past(0, 1, keys, keys)])[0]))
    torch.set_num_threads(threads)
    return f"1-thread CPU ms per forward: target 1 decode row {dec:.1f}, EAGLE-3 step {step:.1f} ({step / dec:.2f}x)"


def generate(
    target,
    tokenizer,
    prompts: list[list[int]],
    new: int,
    draft=None,
    k: int = 3,
    mtp=None,
    clock=time.perf_counter,
    limit: int | None = None,
    grammar: Grammar | None = None,
    eagle3=None,
) -> tuple[float, list[list[int]], SpecDecodeStats | None]:
    config = EngineConfig(max_num_seqs=len(prompts), max_model_len=1024, num_pages=len(prompts) * 80, page_size=16)
    spec = SpeculativeConfig(k, disable_by_batch_size=limit) if draft is not None or mtp is not None or eagle3 is not None else None
    engine = LLMEngine(target, tokenizer, config, draft_model=draft, speculative=spec, mtp_layer=mtp, eagle3_head=eagle3)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=grammar is None, structured_outputs=grammar)
    out: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
        out[str(i)] = []
    decode = 0.0
    while engine.has_unfinished():
        prefill = any(len(v) == 0 for v in out.values())
        start = clock()
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        if not prefill:
            decode += clock() - start
    tokens = [out[str(i)] for i in range(len(prompts))]
    decoded = sum(len(t) - 1 for t in tokens)  # the first token of each comes with its prefill
    return decoded / decode, tokens, engine.spec_stats


def verification_form(form: str) -> None:
    """Make the engine's runner verify in `form`: "stepwise" (its own choice: per-position KDA states where the step allows,
    serve/spec_states.py) or "chunked" (every verification in the chunked prefill form with the snapshot and recompute, what
    the engine did before; for the same-run comparison only)."""
    runner_module.stepwise_verification = stepwise_verification if form == "stepwise" else (lambda *args: None)  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--k", type=int, nargs="+", default=[3])
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--drafts", nargs="+", default=["self", "half", "mtp"], choices=["self", "half", "mtp", "eagle3"])
    ap.add_argument("--eagle3-head", default="shipped", help="an EAGLE-3 head folder, or 'shipped' (openk3/assets/tiny/eagle3)")
    ap.add_argument("--mtp-steps", type=int, default=150, help="training steps of the MTP layer (batches of 8 x 64 tokens)")
    ap.add_argument("--mtp-layer", help="instead of training one: a saved MTP layer's state dict, or 'shipped' (the demo assets' layer)")
    ap.add_argument("--prompts", default="stories", choices=["stories", "kjv"], help="kjv: openings of held-out KJV chapters")
    ap.add_argument("--forms", nargs="+", default=["stepwise"], choices=["stepwise", "chunked"], help="verification forms, each a row")
    ap.add_argument("--grammar", default="none", choices=["none", "json"], help='json: every request\'s output is {"text": STRING}')
    ap.add_argument("--disable-by-batch-size", type=int, nargs="*", default=[], help="also rows with SpeculativeConfig.disable_by_batch_size N")
    ap.add_argument(
        "--clock", default="wall", choices=["wall", "cpu"], help="wall: elapsed time; cpu: this process's CPU time (with --threads 1, immune to other jobs)"
    )
    args = ap.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    torch.set_num_threads(args.threads)
    target, tokenizer = build_model("tiny", torch.float32, "cpu", 0)
    assert isinstance(target, K3ForCausalLM)
    # a truncated draft keeps whole Attention Residuals blocks (a shorter one breaks the block readers of model.py)
    drafts: dict[str, Any] = {"self": target, "half": truncated_draft(target, target.config.attn_res_block_size or target.config.num_hidden_layers // 2)}
    drafts = {name: d for name, d in drafts.items() if name in args.drafts}
    for m in [target, *drafts.values()]:  # the serving layout build_engine applies (fused projections, the CPU ops)
        apply_serving_layout(m, ServingPlan(torch.device("cpu")))
    mtp_note = ""
    if "mtp" in args.drafts and args.mtp_layer == "shipped":
        folder = resolve_model("tiny")
        if folder is None:
            raise SystemExit("--mtp-layer shipped: the demo model's assets are not installed")
        drafts["mtp"] = load_mtp(folder, target)
        apply_serving_layout(drafts["mtp"], ServingPlan(torch.device("cpu")))
        mtp_note = "; mtp: the layer shipped in openk3/assets/tiny"
    elif "mtp" in args.drafts and args.mtp_layer:
        drafts["mtp"] = new_mtp_layer(target)
        drafts["mtp"].load_state_dict(torch.load(args.mtp_layer))
        apply_serving_layout(drafts["mtp"].eval(), ServingPlan(torch.device("cpu")))
        mtp_note = f"; mtp: loaded from {args.mtp_layer}"
    elif "mtp" in args.drafts:
        start = time.perf_counter()
        drafts["mtp"], first, last = mtp_draft(target, tokenizer, args.mtp_steps)
        mtp_note = f"; mtp: trained {args.mtp_steps} steps in {time.perf_counter() - start:.0f} s, loss {first:.2f} -> {last:.2f}"
    if "mtp" in args.drafts:
        mtp_note += "\n# " + "\n# ".join(forward_costs(target, drafts["mtp"], k) for k in args.k)
    grammar = None
    if args.grammar == "json":
        schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
        grammar = GrammarCompiler(tokenizer, target.config.vocab_size).compile(StructuredOutputs(json=json.dumps(schema)))
    if "eagle3" in args.drafts:
        folder = resolve_model("tiny")
        if args.eagle3_head == "shipped" and folder is None:
            raise SystemExit("--eagle3-head shipped: the demo model's assets are not installed")
        head_dir = folder / "eagle3" if args.eagle3_head == "shipped" and folder is not None else args.eagle3_head
        drafts["eagle3"] = load_eagle3(head_dir, target)
        mtp_note += f"; eagle3: {'the head shipped in openk3/assets/tiny/eagle3' if args.eagle3_head == 'shipped' else head_dir}"
        mtp_note += "\n# " + eagle3_cost(target, drafts["eagle3"])
    texts = ["Once upon a time", "The little robot", "In the morning the sun", "She opened the door and"]
    openings = [tokenizer.encode(t) for t in texts]
    if args.prompts == "kjv":  # the first 32 tokens of each held-out chapter (every 50th), as the model card measures
        openings = [tokenizer.encode(doc)[:32] for doc in split_documents(kjv_chapters())[1]]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    flags = f"--batch {' '.join(map(str, args.batch))} --k {' '.join(map(str, args.k))} --new {args.new} --drafts {' '.join(args.drafts)}"
    flags += f" --forms {' '.join(args.forms)} --clock {args.clock} --threads {args.threads} --prompts {args.prompts}"
    if args.grammar != "none":
        flags += f" --grammar {args.grammar}"
    if args.disable_by_batch_size:
        flags += f" --disable-by-batch-size {' '.join(map(str, args.disable_by_batch_size))}"
    print(f"# benchmarks/speculative.py {flags} --mtp-steps {args.mtp_steps} --eagle3-head {args.eagle3_head}")
    machine = platform.processor() or platform.machine()
    print(f"# demo model (openk3/assets/tiny), fp32, {args.threads} threads, {args.clock} clock, {machine}, commit {commit}{mtp_note}")
    print("| batch | draft | k | verification | disable_by_batch_size | decode tok/s | baseline tok/s | ratio | acceptance | mean accepted length |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    variants = [(form, None) for form in args.forms] + [("stepwise", n) for n in args.disable_by_batch_size]
    for b in args.batch:
        prompts = [openings[i % len(openings)] for i in range(b)]
        generate(target, tokenizer, prompts[:1], 4, grammar=grammar)  # warm-up
        for name, draft in drafts.items():
            for k in args.k:
                # the baseline and each form's speculative run alternate, best of --repeat each: a slow spell hits them all
                base_tps, base_tokens = 0.0, None
                spec: dict[tuple[str, int | None], tuple[float, Any, Any]] = {v: (0.0, None, None) for v in variants}
                for _ in range(args.repeat):
                    b_tps, base_tokens, _ = generate(target, tokenizer, prompts, args.new, clock=clock, grammar=grammar)
                    base_tps = max(base_tps, b_tps)
                    for form, limit in variants:
                        verification_form(form)
                        mtp = draft if name == "mtp" else None
                        head = draft if name == "eagle3" else None
                        other = draft if name in ("self", "half") else None
                        s_tps, tokens, stats = generate(target, tokenizer, prompts, args.new, other, k, mtp, clock, limit, grammar, head)
                        spec[form, limit] = (max(spec[form, limit][0], s_tps), tokens, stats)
                for (form, limit), (tps, tokens, stats) in spec.items():
                    assert stats is not None
                    ratio = f"{tps / base_tps:.2f}x" if tokens == base_tokens else "FAIL (output differs)"
                    acceptance = f"{stats.acceptance_rate:.2f} | {stats.mean_acceptance_length:.2f}"
                    key = "-" if limit is None else str(limit)
                    print(f"| {b} | {name} | {k} | {form} | {key} | {tps:.1f} | {base_tps:.1f} | {ratio} | {acceptance} |", flush=True)
                verification_form("stepwise")


if __name__ == "__main__":
    main()

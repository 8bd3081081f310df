"""Offline throughput of `LLM.generate` against transformers' `generate` on the same weights (fp32, CPU threads).

A ~16M-parameter Kimi-Linear-shaped model (hidden 256, 8 layers of which 2 MLA, 16 experts top-2, vocab 4096) is made with
transformers' native `kimi_linear`, saved, and loaded by both sides. Scenarios (issue 4):
  a: 1 prompt of 128 tokens + 128 new;  b: 16 prompts of 128 + 128;
  c: 64 prompts of 16-512 tokens + 16-256 new (transformers pads to the longest prompt and runs to the longest output; only the
     requested tokens are counted for either side).
Correctness gate: greedy tokens of both sides must agree on a and b (no padding there); on c, four requests rerun alone must give
the engine's batched tokens; a failing check prints FAIL instead of a ratio. Then time to first token and decode ms/token at
several contexts for a KDA-only and a mixed model (engine only).

  python benchmarks/engine_offline.py                    # the full table (slow on 2 CPU threads)
  python benchmarks/engine_offline.py --scale 0.25       # every length scaled down, for a quick look
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

VOCAB = 4096


def make_checkpoint(path: Path, mla_layers: tuple[int, ...], num_layers: int = 8, std: float = 0.1) -> Path:
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=768, moe_intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=128, q_lora_rank=None, qk_rope_head_dim=32, v_head_dim=64,
        qk_nope_head_dim=32, num_local_experts=16, num_experts_per_tok=2, n_shared_experts=1, linear_head_dim=64, linear_num_heads=4,
        layer_types=["full_attention" if i in mla_layers else "linear_attention" for i in range(num_layers)],
        max_position_embeddings=16384, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    model = KimiLinearForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # the default std 0.02 makes all logits nearly equal, so greedy ties would decide the correctness check
        for name, p in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")) and "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.save_pretrained(path)
    return path


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def run_engine(llm, prompts: list[list[int]], new: list[int]) -> tuple[float, list[list[int]], float]:
    from openk3.serve.sampling import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in new]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    ttft = sum(o.outputs[0].metrics.time_to_first_token for o in outs) / len(outs)
    return wall, [list(o.token_ids) for o in outs], ttft


def run_hf(model, prompts: list[list[int]], new: list[int]) -> tuple[float, list[list[int]]]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max(new), min_new_tokens=max(new), do_sample=False, pad_token_id=0)
    wall = time.perf_counter() - start
    return wall, [out[i, width : width + n].tolist() for i, n in enumerate(new)]


def context_latency(llm, context: int, decode_steps: int) -> tuple[float, float]:
    """Time to first token for a `context`-token prompt, then ms per decode token over `decode_steps` tokens."""
    from openk3.serve.sampling import SamplingParams

    eng = llm.engine
    eng.add_request(f"ctx{context}", prompts_of([context], 7)[0], SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True))
    start = time.perf_counter()
    first = None
    while eng.has_unfinished():
        got_token = bool(eng.step())  # a long prompt takes several chunked-prefill steps before its first token
        if first is None and got_token:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return first - start, (end - first) / decode_steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every prompt/output length (quick runs)")
    ap.add_argument("--scenarios", default="abc")
    ap.add_argument("--contexts", default="256,2048,8192")
    ap.add_argument("--decode-steps", type=int, default=64)
    ap.add_argument("--init-std", type=float, default=0.1, help="std of the random weights (larger: fewer greedy near-ties)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import KimiLinearForCausalLM

    from openk3.llm import LLM
    from openk3.serve.cpu_heap import keep_heap_for_reuse
    from openk3.serve.tokenizer import ByteTokenizer

    s = lambda n: max(1, int(n * args.scale))
    g = torch.Generator().manual_seed(5)
    c_prompt = [s(int(x)) for x in torch.randint(16, 513, (64,), generator=g)]
    c_new = [s(int(x)) for x in torch.randint(16, 257, (64,), generator=g)]
    scenarios = {
        "a": ("1 x (128 + 128)", [s(128)], [s(128)]),
        "b": ("16 x (128 + 128)", [s(128)] * 16, [s(128)] * 16),
        "c": ("64 x (16-512 + 16-256)", c_prompt, c_new),
    }
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"command: python benchmarks/engine_offline.py --threads {args.threads} --scale {args.scale} --scenarios {args.scenarios} --init-std {args.init_std}")
    print(f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} threads; commit {commit}")
    with tempfile.TemporaryDirectory() as tmp:
        path = make_checkpoint(Path(tmp) / "mixed", mla_layers=(3, 7), std=args.init_std)
        hf = KimiLinearForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        keep_heap_for_reuse()  # as `openk3 serve` does; process-wide, so transformers' runs below have it too
        tok = ByteTokenizer(VOCAB)  # token-id prompts; the transformers checkpoint ships no tokenizer
        llm = LLM(str(path), tok, max_num_seqs=64, max_num_batched_tokens=2048, cache_memory_bytes=512 * 2**20)
        print("\n| scenario | new tokens | engine tok/s | transformers tok/s | speed-up | engine mean TTFT s | greedy tokens equal |")
        print("|---|---|---|---|---|---|---|")
        for key in args.scenarios:
            name, lens, new = scenarios[key]
            prompts = prompts_of(lens, seed=ord(key))
            e_wall, e_tokens, ttft = run_engine(llm, prompts, new)
            h_wall, h_tokens = run_hf(hf, prompts, new)
            total = sum(new)
            padded = len(set(lens)) > 1
            if padded:  # transformers' padded batch is not a token-exact reference: check 4 requests run alone instead
                alone = [run_engine(llm, [prompts[i]], [new[i]])[1][0] for i in range(4)]
                ok = alone == e_tokens[:4]
                equal = f"vs engine alone: {ok}"
            else:
                ok = e_tokens == h_tokens
                equal = str(ok)
            ratio = f"{h_wall / e_wall:.2f}x" if ok else "FAIL (tokens differ)"
            print(f"| {key}: {name} | {total} | {total / e_wall:.1f} | {total / h_wall:.1f} | {ratio} | {ttft:.3f} | {equal} |")

        contexts = [s(int(c)) for c in args.contexts.split(",") if c]
        print("\n| model | context | TTFT s | decode ms/token |")
        print("|---|---|---|---|")
        for label, mla in (("KDA-only", ()), ("mixed 2/8 MLA", (3, 7))):
            ckpt = make_checkpoint(Path(tmp) / f"ctx{len(mla)}", mla_layers=mla, std=args.init_std)
            ctx_llm = LLM(str(ckpt), tok, max_num_seqs=4, max_num_batched_tokens=2048, cache_memory_bytes=256 * 2**20)
            for c in contexts:
                ttft, ms = context_latency(ctx_llm, c, args.decode_steps)
                print(f"| {label} | {c} | {ttft:.3f} | {ms:.1f} |")


if __name__ == "__main__":
    main()

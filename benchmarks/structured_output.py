"""Decode throughput with and without a JSON schema on the demo model `tiny`, at batch 1 and 16 (issue 19 item 5).

Both sides generate exactly the same number of tokens per request: the free side runs with ignore_eos to max_tokens, the
constrained side gets a schema whose shortest valid document is longer than max_tokens (an array of 64 bounded integers),
so max_tokens cuts it too. Greedy, so the two sides differ only in the grammar work: the per-step bitmask fill (xgrammar,
C++) and its application, and the per-token matcher advance. The overhead is reported as the ratio constrained / free
throughput, measured in the same run, best of --repeats with the two sides interleaved. A second table times the sampler
alone on random logits, which isolates the grammar's cost from the model (and from a shared machine's noise), and puts
it against the free engine step. The end-to-end ratio also carries what the tokens do to the model: the schema's digits
and commas route to fewer experts than free text, so the MoE step itself can get cheaper.
Correctness gate: a schema with room to finish must give schema-valid JSON for all 16 requests (jsonschema if installed,
else checked by hand), else FAIL instead of a ratio.

  python benchmarks/structured_output.py                  # batch 1 and 16, 64 new tokens each
  python benchmarks/structured_output.py --new 128 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from typing import Any

import torch

ITEMS = 64
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"values": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": ITEMS, "maxItems": ITEMS}},
    "required": ["values"],
    "additionalProperties": False,
}
SHORT: dict[str, Any] = {  # for the correctness gate: finishes well within max_tokens
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"],
    "additionalProperties": False,
}


def valid(doc: Any) -> bool:
    try:
        import jsonschema

        jsonschema.validate(doc, SHORT)
        return True
    except ImportError:
        return isinstance(doc, dict) and set(doc) == {"name", "n", "ok"} and len(doc["name"]) <= 8 and 0 <= doc["n"] <= 99 and isinstance(doc["ok"], bool)
    except Exception:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=64, help="new tokens per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from openk3.llm import LLM
    from openk3.serve.sampling import SamplingParams
    from openk3.serve.structured.compiler import GrammarCompiler
    from openk3.serve.structured.spec import StructuredOutputs

    llm = LLM("tiny")
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size)
    t0 = time.perf_counter()
    long_grammar = compiler.compile(StructuredOutputs(json=json.dumps(SCHEMA)))
    compile_ms = (time.perf_counter() - t0) * 1e3
    short_grammar = compiler.compile(StructuredOutputs(json=json.dumps(SHORT)))
    prompts = [f"Record {i}: the measurements are" for i in range(16)]

    gate = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=200, structured_outputs=short_grammar))
    ok = all(o.outputs[0].finish_reason == "stop" and valid(json.loads(o.outputs[0].text)) for o in gate)

    def seconds(batch: int, grammar) -> float:
        params = SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=grammar is None, structured_outputs=grammar)
        t = time.perf_counter()
        outs = llm.generate(prompts[:batch], params)
        elapsed = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == args.new for o in outs), "both sides must generate max_tokens"
        return elapsed

    def throughputs(batch: int) -> tuple[float, float]:
        """Best of `repeats` for each side, the two sides interleaved so that a shared machine's drift hits both alike."""
        seconds(batch, None)  # warm-up (kernels, caches)
        free, constrained = float("inf"), float("inf")
        for _ in range(args.repeats):
            free = min(free, seconds(batch, None))
            constrained = min(constrained, seconds(batch, long_grammar))
        return batch * args.new / free, batch * args.new / constrained

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"command: python benchmarks/structured_output.py --new {args.new} --repeats {args.repeats} --threads {args.threads}")
    print(f"machine: {platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} torch threads; commit {commit}")
    print(f"schema compile (first, uncached): {compile_ms:.1f} ms; correctness gate (16 requests, schema-valid JSON): {'ok' if ok else 'FAIL'}")
    print()
    print("| batch | free tok/s | json-schema tok/s | schema / free |")
    print("|---|---|---|---|")
    step_ms: dict[int, float] = {}
    for batch in (1, 16):
        free, constrained = throughputs(batch)
        step_ms[batch] = batch / free * 1e3  # one token per request per decode step
        ratio = f"{constrained / free:.3f}" if ok else "FAIL"
        print(f"| {batch} | {free:.1f} | {constrained:.1f} | {ratio} |")
    print()
    print("the grammar's own cost, the sampler alone on random logits (60 steps, the same rows):")
    print("| batch | sampler ms/step free | with schema | added ms/step | added / free engine step |")
    print("|---|---|---|---|---|")
    for batch in (1, 16):
        base, with_schema = sampler_ms(batch, None), sampler_ms(batch, long_grammar)
        share = f"{(with_schema - base) / step_ms[batch]:.3f}" if ok else "FAIL"
        print(f"| {batch} | {base:.3f} | {with_schema:.3f} | {with_schema - base:.3f} | {share} |")
    llm.close()


def sampler_ms(batch: int, grammar) -> float:
    from openk3.serve.sampler import Sampler, SamplingRow
    from openk3.serve.sampling import SamplingParams

    best = float("inf")
    logits = torch.randn(batch, 4096, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0, structured_outputs=grammar)
    for _ in range(3):
        sampler, lists = Sampler(0), [[5] for _ in range(batch)]
        t = time.perf_counter()
        for _ in range(60):
            out = sampler(logits.clone(), [SamplingRow(params, None, ids, 1, frozenset({1})) for ids in lists]).token_ids
            for ids, token in zip(lists, out, strict=True):
                ids.append(token)
        best = min(best, (time.perf_counter() - t) / 60 * 1e3)
    return best


if __name__ == "__main__":
    main()

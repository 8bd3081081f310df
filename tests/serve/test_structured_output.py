"""Structured output in the sampler: one grammar bitmask per step for the constrained rows, per-request matcher state that
is a cache of the output tokens, the vocabularies of the project's three tokenizers, the compiler's cache and its errors."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from openk3.serve.kimi_tokenizer import KimiTokenizer
from openk3.serve.loading import ASSETS
from openk3.serve.sampler import Sampler, SamplingRow
from openk3.serve.sampling import SamplingParams
from openk3.serve.structured.compiler import GrammarCompiler, GrammarError
from openk3.serve.structured.spec import StructuredOutputs
from openk3.serve.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from tests.serve.test_kimi_tokenizer import write_kimi_tokenizer

pytest.importorskip("xgrammar", reason="the grammar engine")

VOCAB = 300  # a model vocabulary padded past the byte tokenizer's 259 ids
BYTES = ByteTokenizer(259)
EOS = 257


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(BYTES, VOCAB)


def run(sampler: Sampler, params: list[SamplingParams], steps: int, seed: int = 0, fresh_lists: bool = False) -> list[list[int]]:
    """Drive the sampler as the runner does (random logits, each request's own, and its own generator; one list per request
    that grows), until each row stops."""
    table = [torch.randn(steps, VOCAB, generator=torch.Generator().manual_seed(seed + i)) for i in range(len(params))]
    gens = [torch.Generator().manual_seed(100 + i) for i in range(len(params))]
    tokens: list[list[int]] = [[65] for _ in params]
    done = [False] * len(params)
    for step in range(steps):
        live = [i for i in range(len(params)) if not done[i]]
        if not live:
            break
        logits = torch.stack([table[i][step] for i in live])
        rows = [SamplingRow(params[i], gens[i], list(tokens[i]) if fresh_lists else tokens[i], 1, frozenset({EOS})) for i in live]
        for i, t in zip(live, sampler(logits, rows).token_ids, strict=True):
            tokens[i].append(t)
            done[i] = t == EOS
    return [t[1:] for t in tokens]


def text(ids: list[int]) -> str:
    return bytes(t for t in ids if t < 256).decode()


def test_regex_rows_match_and_free_rows_are_untouched(compiler: GrammarCompiler) -> None:
    g = compiler.compile(StructuredOutputs(regex=r"[a-c]{2,4}-[0-9]{2}"))
    free = SamplingParams(seed=3, max_tokens=None)
    constrained = SamplingParams(temperature=1.0, structured_outputs=g, max_tokens=None)
    mixed = run(Sampler(0), [free, constrained, constrained.replace(temperature=0.0)], steps=30)
    for out in mixed[1:]:
        assert out[-1] == EOS and re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", text(out[:-1]))
    alone = run(Sampler(0), [free], steps=30)
    assert mixed[0] == alone[0]  # a seeded free row draws the same tokens whatever grammar rows share its batch


def test_state_is_rebuilt_from_the_output_tokens(compiler: GrammarCompiler) -> None:
    g = compiler.compile(StructuredOutputs(json=json.dumps({"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"]})))
    params = [SamplingParams(temperature=0.0, structured_outputs=g), SamplingParams(temperature=0.0, structured_outputs=g)]
    kept = run(Sampler(0), params, steps=40)
    rebuilt = run(Sampler(0), params, steps=40, fresh_lists=True)
    assert kept == rebuilt
    for out in kept:
        assert out[-1] == EOS and isinstance(json.loads(text(out[:-1]))["n"], int)


def test_states_follow_the_batch(compiler: GrammarCompiler) -> None:
    g = compiler.compile(StructuredOutputs(choice=("yes", "no")))
    sampler = Sampler(0)
    rows = [SamplingRow(SamplingParams(structured_outputs=g), None, [65], 1, frozenset({EOS})) for _ in range(3)]
    sampler(torch.zeros(3, VOCAB), rows)
    assert len(sampler.grammars) == 3
    sampler(torch.zeros(1, VOCAB), [SamplingRow(SamplingParams(), None, [65], 1, frozenset({EOS}))])
    assert len(sampler.grammars) == 0


def test_two_requests_with_the_same_tokens_keep_their_own_states(compiler: GrammarCompiler) -> None:
    """States are keyed by request id: one token list object for two requests (and then two equal ones) never mixes them."""
    grammars = {"a": compiler.compile(StructuredOutputs(choice=("yes",))), "b": compiler.compile(StructuredOutputs(choice=("yak",)))}
    sampler = Sampler(0)
    shared = [65]
    lists = {"a": shared, "b": shared}
    for _ in range(4):
        rows = [SamplingRow(SamplingParams(temperature=0.0, structured_outputs=grammars[r]), None, lists[r], 1, frozenset({EOS}), r) for r in "ab"]
        out = sampler(torch.zeros(2, VOCAB), rows).token_ids
        lists = {r: [*lists[r], t] for r, t in zip("ab", out, strict=True)}
        assert len(sampler.grammars) == 2
    assert [text(lists[r][1:]) for r in "ab"] == ["yes", "yak"]
    twice = [SamplingRow(SamplingParams(structured_outputs=grammars["a"]), None, [65], 1, frozenset({EOS}), "a") for _ in range(2)]
    with pytest.raises(ValueError, match="same request"):
        sampler(torch.zeros(2, VOCAB), twice)


def test_stop_tokens_only_where_the_grammar_accepts(compiler: GrammarCompiler) -> None:
    g = compiler.compile(StructuredOutputs(choice=("ab",)))
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0  # the model wants to stop at once
    out = run_fixed(g, logits, steps=4)
    assert out == [ord("a"), ord("b"), EOS]


def run_fixed(g, logits: torch.Tensor, steps: int) -> list[int]:
    sampler, tokens = Sampler(0), [65]
    for _ in range(steps):
        (t,) = sampler(logits.clone(), [SamplingRow(SamplingParams(temperature=0.0, structured_outputs=g), None, tokens, 1, frozenset({EOS}))]).token_ids
        tokens.append(t)
        if t == EOS:
            break
    return tokens[1:]


def test_compiler_caches_and_names_the_field(compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    spec = StructuredOutputs(json=json.dumps(schema))
    before = compiler.num_compiled
    assert compiler.compile(spec) is compiler.compile(StructuredOutputs(json=json.dumps(schema)))
    assert compiler.num_compiled == before + 1
    for bad, field in [
        (StructuredOutputs(json='{"type": "objec"}'), "json"),
        (StructuredOutputs(regex="("), "regex"),
        (StructuredOutputs(grammar="x"), "grammar"),
    ]:
        with pytest.raises(GrammarError) as e:
            compiler.compile(bad)
        assert e.value.field == field
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=("b",))


def test_sampling_params_refuse_what_a_grammar_cannot_honour(compiler: GrammarCompiler) -> None:
    g = compiler.compile(StructuredOutputs(choice=("x",)))
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(structured_outputs=g, min_tokens=2)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(structured_outputs=g, ignore_eos=True)
    SamplingParams(structured_outputs=g, ignore_eos=True, stop_token_ids=(5,))
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="{}")  # type: ignore[arg-type]


def kimi(tmp_path: Path) -> Tokenizer:
    write_kimi_tokenizer(tmp_path)
    return KimiTokenizer(tmp_path)


@pytest.mark.parametrize("which", ["bytes", "hf", "kimi"])
def test_each_tokenizer_yields_text_that_matches(which: str, tmp_path: Path) -> None:
    makers: dict[str, Callable[[], Tokenizer]] = {"bytes": lambda: BYTES, "hf": lambda: HFTokenizer(ASSETS / "tiny"), "kimi": lambda: kimi(tmp_path)}
    tok = makers[which]()
    vocab = tok.vocab_size + 7
    g = GrammarCompiler(tok, vocab).compile(StructuredOutputs(regex=r"(hello|world) [0-9]{3}"))
    eos = tok.eos_token_id
    assert eos is not None
    sampler, tokens, gen = Sampler(0), [0], torch.Generator().manual_seed(1)
    for _ in range(40):
        row = SamplingRow(SamplingParams(structured_outputs=g), None, tokens, 1, frozenset({eos}))
        (t,) = sampler(torch.randn(1, vocab, generator=gen), [row]).token_ids
        tokens.append(t)
        if t == eos:
            break
    assert tokens[-1] == eos and re.fullmatch(r"(hello|world) [0-9]{3}", tok.decode(tokens[1:-1]))

"""Speculative decoding of requests with a grammar (serve/spec_logits.py, serve/structured/matchers.py): greedy output equals
non-speculative decoding token for token (JSON schema, regex, choice and a K3 tool call, beside unconstrained rows, with
a draft model that agrees and one that does not, and with the demo model's shipped MTP layer), each request's matcher
stays in the state a plain decode of its output leaves (engine.check_integrity after every step), drafts are cut at the
first token the grammar rejects, and the rejection rule on the masked distributions keeps the target distribution
(a seeded statistical test on a small vocabulary)."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.request import Request
from openk3.serve.sampling import SamplingParams
from openk3.serve.spec_logits import cut_drafts, verified_logits
from openk3.serve.speculative import SpeculativeConfig, verify
from openk3.serve.structured.compiler import GrammarCompiler
from openk3.serve.structured.matchers import GrammarStates
from openk3.serve.structured.spec import Grammar, StructuredOutputs
from openk3.serve.tokenizer import ByteTokenizer, Tokenizer
from tests.serve.test_speculative import model

pytest.importorskip("xgrammar", reason="the grammar engine")

BASE: dict[str, Any] = dict(page_size=4, num_pages=200, max_num_seqs=4, max_model_len=256, long_prefill_token_threshold=16)
STOP = 255  # a byte no UTF-8 text holds: the grammars' stop token on the byte vocabulary
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}, "tag": {"enum": ["red", "green", "blue"]}, "s": {"type": "string", "maxLength": 4}},
    "required": ["n", "tag", "s"],
    "additionalProperties": False,
}
REGEX = r"[a-f]{3,8}-[0-9]{2,5}"
CHOICES = ("alpha", "beta", "gamma delta")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target() -> K3ForCausalLM:
    return model(5)


def k3_tool_call(tokenizer: Tokenizer, vocab: int) -> Grammar:
    """The grammar of a forced K3 tool call (api/tool_choice.py), its markers written as text (the byte vocabulary has
    no marker tokens)."""
    from openk3.api.chat_format import ChatFormat
    from openk3.api.protocol import Tool
    from openk3.api.tool_choice import ToolPlan

    params = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["days"]}
    tool = Tool.model_validate({"type": "function", "function": {"name": "forecast", "parameters": params, "strict": True}})
    spec = ToolPlan(ChatFormat.KIMI_K3, (tool,), frozenset({"forecast"}), forced="forecast").call_grammar(0)
    assert spec is not None
    return GrammarCompiler(tokenizer, vocab).compile(spec)


def k3_marker_call(tmp_path: Path) -> tuple[Tokenizer, Grammar, dict[str, int]]:
    """A Kimi tokenizer with K3's markers as special tokens (tests/api/test_k3_encoding.py), and the forced call's grammar
    as the server builds it for such a tokenizer (api/served_model.py): each marker one token, the text between them the
    prompt encoder's ids."""
    from openk3.api.chat_format import CALL_MARKUP, ChatFormat
    from openk3.api.protocol import Tool
    from openk3.api.tool_choice import Spelling, ToolPlan
    from tests.api.test_k3_encoding import k3_tokenizer

    tok = k3_tokenizer(tmp_path)
    markup = CALL_MARKUP[ChatFormat.KIMI_K3] & tok.special_token_strings
    markers = {m: ids[0] for m in markup if len(ids := tok.encode_with_plain(m, ())) == 1}
    spelling = Spelling(markers, lambda text: tok.encode_with_plain(text, ((0, len(text)),)))
    params = {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["days"]}
    tool = Tool.model_validate({"type": "function", "function": {"name": "forecast", "parameters": params, "strict": True}})
    spec = ToolPlan(ChatFormat.KIMI_K3, (tool,), frozenset({"forecast"}), forced="forecast").call_grammar(0, spelling)
    assert spec is not None
    return tok, GrammarCompiler(tok, tok.vocab_size, markup=markup).compile(spec), markers


def grammars(tokenizer: Tokenizer, vocab: int) -> dict[str, Grammar]:
    compiler = GrammarCompiler(tokenizer, vocab)
    return {
        "json": compiler.compile(StructuredOutputs(json=json.dumps(SCHEMA))),
        "regex": compiler.compile(StructuredOutputs(regex=REGEX)),
        "choice": compiler.compile(StructuredOutputs(choice=CHOICES)),
        "tool": k3_tool_call(tokenizer, vocab),
    }


def run(target, params: list[SamplingParams], prompts: list[list[int]], draft=None, k: int = 3, **cfg: Any) -> tuple[list[list[int]], LLMEngine]:
    config = EngineConfig(**{**BASE, **cfg})
    engine = LLMEngine(target, ByteTokenizer(256), config, draft_model=draft, speculative=SpeculativeConfig(k) if draft else None)
    out: dict[str, list[int]] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
        out[str(i)] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        engine.check_integrity()  # every running request's matcher is where its output leaves it
    return [out[str(i)] for i in range(len(prompts))], engine


def text(ids: list[int]) -> str:
    return bytes(t for t in ids if t != STOP).decode(errors="replace")


@pytest.mark.parametrize(("draft_seed", "k"), [(5, 3), (11, 2), (11, 4)])
def test_greedy_output_with_grammars_equals_plain_decoding(target, draft_seed: int, k: int) -> None:
    """Four grammars and two unconstrained rows through 4 slots (admissions beside verifications)."""
    g = grammars(ByteTokenizer(256), 256)
    constrained = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=g[name], stop_token_ids=(STOP,)) for name in g]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [constrained[0], free, *constrained[1:], free]
    prompts = [[40 + i, 41, 42, 43 + i] * (1 + i % 3) for i in range(len(params))]
    plain, _ = run(target, params, prompts)
    spec, engine = run(target, params, prompts, draft=model(draft_seed), k=k)
    assert spec == plain
    stats = engine.spec_stats
    assert stats is not None and stats.num_accepted_tokens > 0 or draft_seed != 5
    assert stats is not None and stats.num_drafts > 0
    json_out, regex_out, choice_out = spec[0], spec[2], spec[3]
    assert json_out[-1] == STOP and set(json.loads(text(json_out), strict=False)) == set(SCHEMA["required"])
    assert regex_out[-1] == STOP and re.fullmatch(REGEX, text(regex_out))
    assert choice_out[-1] == STOP and text(choice_out) in CHOICES


def test_k3_tool_call_with_marker_tokens(tmp_path: Path) -> None:
    """A forced K3 call whose markers are single special tokens, on a model of that tokenizer's vocabulary, with a random
    draft model (another seed): its drafts are steered by the grammar (serve/draft_steering.py)."""
    tok, grammar, markers = k3_marker_call(tmp_path)
    config = dataclasses.replace(debug(), vocab_size=tok.vocab_size)

    def lm(seed: int) -> K3ForCausalLM:
        m = K3ForCausalLM(config)
        m.init_weights(seed=seed)
        return m.eval()

    target, draft = lm(5), lm(11)
    params = SamplingParams(temperature=0, max_tokens=100, structured_outputs=grammar)
    prompts = [tok.encode("Call the forecast tool"), tok.encode("What is the weather")]

    def generate(draft_model: K3ForCausalLM | None) -> tuple[list[list[int]], LLMEngine]:
        spec = SpeculativeConfig(3) if draft_model is not None else None
        engine = LLMEngine(target, tok, EngineConfig(**BASE), draft_model=draft_model, speculative=spec)
        out: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            engine.add_request(str(i), prompt, params)
            out[str(i)] = []
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
            engine.check_integrity()
        return [out[str(i)] for i in range(len(prompts))], engine

    plain, _ = generate(None)
    spec, engine = generate(draft)
    assert spec == plain
    assert engine.spec_stats is not None and engine.spec_stats.num_drafts > 0
    for out in spec:
        assert out[-1] == tok.eos_token_id and markers["<|open|>"] in out and markers["<|close|>"] in out


def test_a_copy_of_the_target_drafts_inside_the_grammar(target, monkeypatch) -> None:
    """Drafts are drawn under the grammar's mask (serve/draft_steering.py): a copy of the target then proposes exactly the
    target's masked argmax, so (nearly) every draft is kept. Unsteered -- the draft's raw argmax, cut before the first
    token the grammar rejects -- the same draft model gets few drafts past the grammar on these random weights. The
    output is plain decoding's either way."""
    g = grammars(ByteTokenizer(256), 256)
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=gr, stop_token_ids=(STOP,)) for gr in g.values()]
    prompts = [[70 + i, 71, 72] * 3 for i in range(len(params))]
    plain, _ = run(target, params, prompts)
    steered, engine = run(target, params, prompts, draft=model(5), k=3)
    on = engine.spec_stats
    monkeypatch.setattr("openk3.serve.speculative.DraftSteering.__bool__", lambda self: False)
    cut, engine = run(target, params, prompts, draft=model(5), k=3)
    off = engine.spec_stats
    assert steered == cut == plain
    assert on is not None and off is not None
    assert on.num_accepted_tokens >= 0.95 * on.num_draft_tokens and on.mean_acceptance_length > 3.5, on
    assert on.num_accepted_tokens > 5 * off.num_accepted_tokens, (on, off)


def test_preemption_rebuilds_the_grammar_state(target) -> None:
    """A cache too small for the batch preempts requests mid-output; their matchers are rebuilt from the output tokens
    when they run again, and greedy output is still plain decoding's."""
    g = grammars(ByteTokenizer(256), 256)
    params = [SamplingParams(temperature=0, max_tokens=60, structured_outputs=gr, stop_token_ids=(STOP,)) for gr in g.values()]
    prompts = [[60 + i, 61, 62] * 4 for i in range(len(params))]
    cfg = dict(num_pages=24, max_num_batched_tokens=12, max_model_len=80)
    plain, _ = run(target, params, prompts, **cfg)
    spec, engine = run(target, params, prompts, draft=model(11), k=3, **cfg)
    assert spec == plain
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.spec_stats is not None and engine.spec_stats.num_drafts > 0


def test_sampled_rows_with_grammars_match_them(target) -> None:
    """Sampled rows draw drafts from the draft's distribution q, which the grammar restricts before the rejection rule."""
    g = grammars(ByteTokenizer(256), 256)
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=80, structured_outputs=g[name], stop_token_ids=(STOP,)) for i, name in enumerate(g)]
    prompts = [[50 + i, 51, 52] for i in range(len(params))]
    spec, engine = run(target, params, prompts, draft=model(5), k=3)
    assert engine.spec_stats is not None and engine.spec_stats.num_accepted_tokens > 0
    assert spec[0][-1] == STOP and set(json.loads(text(spec[0]), strict=False)) == set(SCHEMA["required"])
    assert spec[1][-1] == STOP and re.fullmatch(REGEX, text(spec[1]))
    assert spec[2][-1] == STOP and text(spec[2]) in CHOICES


def request(grammar: Grammar, output: list[int], drafts: list[int], q: torch.Tensor | None, temperature: float) -> Request:
    req = Request("r", [65], SamplingParams(temperature=temperature, structured_outputs=grammar, stop_token_ids=(STOP,)))
    req.token_ids.extend(output)
    req.draft_token_ids, req.draft_probs = list(drafts), q
    return req


def test_drafts_are_cut_at_the_first_token_the_grammar_rejects() -> None:
    grammar = grammars(ByteTokenizer(256), 256)["regex"]
    states = GrammarStates()
    a, b, dash, nine = (ord(c) for c in "ab-9")
    for drafts, kept in [([a, b, dash, nine], 4), ([a, nine, b], 1), ([nine], 0), ([b, a, dash, dash], 3)]:
        req = request(grammar, [a, b], drafts, None, 0.0)  # after "ab": one more letter at least, then letters or '-'
        cut_drafts(states, req, 256)
        assert req.draft_token_ids == drafts[:kept]
    # the matcher is back where it was: the output "ab" still needs a letter next
    logits = verified_logits(torch.zeros(1, 256), request(grammar, [a, b], [], None, 0.0), states)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [ord(c) for c in "abcdef"]


def test_rejection_rule_on_masked_distributions_keeps_the_target_distribution() -> None:
    """Regex x[ab][ab]: after the pending 'x' each position allows a or b. The draft's q puts mass on c and d too (drafts
    the grammar rejects, cut there); the two kept tokens must be distributed as the masked target p at each position.
    Restricting q is what makes it exact: the rule with the unrestricted q and the cut gives 0.38 for 'a' at position 0,
    not p's 0.27."""
    vocab = 256
    grammar = GrammarCompiler(ByteTokenizer(vocab), vocab).compile(StructuredOutputs(regex="x[ab][ab]"))
    a, b, c, d = (ord(ch) for ch in "abcd")
    logits = torch.full((3, vocab), -30.0)
    logits[:2, [a, b, c, d]] = torch.tensor([[0.0, 1.0, 2.0, 0.5], [1.2, 0.2, 0.0, 0.0]])
    q = torch.zeros(2, vocab)
    q[:, [a, b, c, d]] = torch.tensor([[0.5, 0.1, 0.2, 0.2], [0.1, 0.3, 0.3, 0.3]])
    gen, states = torch.Generator().manual_seed(0), GrammarStates()
    trials = 12000
    seen: Counter[tuple[int, ...]] = Counter()
    for _ in range(trials):
        drafts = torch.multinomial(q, 1, generator=gen).flatten().tolist()
        req = request(grammar, [ord("x")], drafts, q.clone(), 1.0)
        cut_drafts(states, req, vocab)
        rows = logits[: len(req.draft_token_ids) + 1]  # the verification scores the pending token and the kept drafts
        q_kept = req.draft_probs if req.draft_probs is not None else torch.zeros(0, vocab)  # none kept: a plain draw from p
        run, _ = verify(verified_logits(rows, req, states), req.draft_token_ids, q_kept, req.sampling_params, gen)
        seen[tuple(run[:2])] += 1  # a run of one token (a rejection) is completed by the next step: count it once more
    p0 = logits[0, [a, b]].softmax(-1)
    first = torch.tensor([sum(n for r, n in seen.items() if r[0] == t) for t in (a, b)], dtype=torch.float64) / trials
    assert torch.allclose(first, p0.double(), atol=0.016), (first, p0)  # 4 standard errors of 12000 draws
    two = [(r, n) for r, n in seen.items() if len(r) == 2]
    total = sum(n for _, n in two)
    second = torch.tensor([sum(n for r, n in two if r[1] == t) for t in (a, b)], dtype=torch.float64) / total
    assert torch.allclose(second, logits[1, [a, b]].softmax(-1).double(), atol=0.035), second  # of about 3000 runs
    assert sum(n for r, n in seen.items() if len(r) == 1) > trials // 10  # cuts and rejections happened


def test_mtp_draft_on_the_demo_model_with_grammars() -> None:
    """LLM("tiny", speculative_method="mtp"): the shipped MTP layer drafts for constrained requests; output identical."""
    settings: dict[str, Any] = dict(max_num_seqs=4, max_model_len=512, num_pages=128, page_size=16)
    with LLM("tiny", **settings) as plain:
        tok, vocab = plain.tokenizer, plain.engine.model_config.vocab_size
        g = grammars(tok, vocab)
        eos = tok.eos_token_id
        assert eos is not None
        params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=gr) for gr in g.values()]
        prompts = ["The planet has", "In the beginning", "Pick one:", "Call the tool"]
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    with LLM("tiny", speculative_method="mtp", num_speculative_tokens=2, **settings) as spec:
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
        stats = spec.engine.spec_stats
    assert got == want
    assert stats is not None and stats.num_accepted_tokens > 0
    assert set(json.loads(tok.decode([t for t in got[0] if t != eos]), strict=False)) == set(SCHEMA["required"])

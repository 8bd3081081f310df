"""Speculative decoding of requests that ask for logprobs, or set penalties or token rules (serve/spec_logits.py): the
logprobs of each kept token come from its verified position and equal non-speculative decoding's; penalties and token
rules see the output as it stands at each position, so greedy output is plain decoding's token for token, with a draft
that agrees (long accepted runs) and one that does not (rollbacks)."""

from __future__ import annotations

from typing import Any

import pytest

from openk3.model import K3ForCausalLM
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.request import TokenLogprobs
from openk3.serve.sampling import SamplingParams
from openk3.serve.speculative import SpeculativeConfig
from openk3.serve.tokenizer import ByteTokenizer
from tests.serve.test_speculative import model

BASE: dict[str, Any] = dict(page_size=4, num_pages=200, max_num_seqs=4, max_model_len=256, long_prefill_token_threshold=16)
PROMPTS = [list(range(40, 70)), [5, 6, 7, 8] * 5, [100, 3, 77], list(range(90, 60, -1))]
MAX = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def target() -> K3ForCausalLM:
    return model(5)


def run(target, params: list[SamplingParams], draft=None, k: int = 3) -> tuple[list[list[int]], list[list[TokenLogprobs]], LLMEngine]:
    engine = LLMEngine(target, ByteTokenizer(256), EngineConfig(**BASE), draft_model=draft, speculative=SpeculativeConfig(k) if draft else None)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprobs]] = {}
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(str(i), prompt, p)
        tokens[str(i)], logprobs[str(i)] = [], []
    while engine.has_unfinished():
        for o in engine.step():
            tokens[o.request_id].extend(o.new_token_ids)
            if o.new_logprobs is not None:
                assert len(o.new_logprobs) == len(o.new_token_ids)
                logprobs[o.request_id].extend(o.new_logprobs)
        engine.check_integrity()
    ids = [str(i) for i in range(len(PROMPTS))]
    return [tokens[i] for i in ids], [logprobs[i] for i in ids], engine


@pytest.mark.parametrize("draft_seed", [5, 11])
def test_logprobs_equal_plain_decoding(target, draft_seed: int) -> None:
    params = [GREEDY.replace(logprobs=3), GREEDY.replace(logprobs=0), GREEDY, GREEDY.replace(logprobs=1, max_tokens=9)]
    want_tokens, want, _ = run(target, params)
    got_tokens, got, engine = run(target, params, draft=model(draft_seed))
    assert got_tokens == want_tokens
    assert engine.spec_stats is not None and engine.spec_stats.num_drafts > 0
    for g_row, w_row, p in zip(got, want, params, strict=True):
        assert len(g_row) == len(w_row) == (0 if p.logprobs is None else p.max_tokens)
        for g, w in zip(g_row, w_row, strict=True):
            assert g.token_id == w.token_id and [t for t, _ in g.top] == [t for t, _ in w.top]
            assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
            assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-5)


@pytest.mark.parametrize("draft_seed", [5, 11])
def test_penalties_and_token_rules_give_plain_decodings_output(target, draft_seed: int) -> None:
    plain_out, _, _ = run(target, [GREEDY] * 4)
    banned = plain_out[1][3]  # a token the unpenalised run writes, banned as a word once the one before it is written
    params = [
        GREEDY.replace(repetition_penalty=1.6),
        GREEDY.replace(frequency_penalty=0.8, presence_penalty=0.4, bad_words_token_ids=((plain_out[1][2], banned),)),
        GREEDY.replace(logit_bias=((plain_out[2][4], 6.0),), presence_penalty=-0.5),
        GREEDY.replace(repetition_penalty=0.7, frequency_penalty=0.3),
    ]
    want, _, _ = run(target, params)
    assert want != plain_out  # the penalties change what is written
    got, _, engine = run(target, params, draft=model(draft_seed))
    assert got == want
    stats = engine.spec_stats
    assert stats is not None and stats.num_drafts > 0
    if draft_seed == 11:
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # rollbacks happened


def test_a_stop_string_inside_a_run_keeps_the_logprobs_of_the_tokens_kept(target) -> None:
    plain_out, _, _ = run(target, [GREEDY] * 4)
    text = ByteTokenizer(256).decode(plain_out[0])
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = [GREEDY.replace(logprobs=2, stop=(stop,)), GREEDY, GREEDY, GREEDY]
    want_tokens, want, _ = run(target, params)
    assert len(want_tokens[0]) < MAX  # the stop string ended it
    got_tokens, got, _ = run(target, params, draft=model(5), k=4)
    assert got_tokens[0] == want_tokens[0] and len(got[0]) == len(want[0]) == len(want_tokens[0])
    assert [lp.token_id for lp in got[0]] == want_tokens[0]


def test_sampled_rows_with_penalties_and_logprobs_speculate(target) -> None:
    """Sampled rows: the rejection rule runs on the penalised p (the draft's q is its own); one logprob per kept token,
    each the raw distribution's at its position (a finite log-probability of the token kept)."""
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=MAX, ignore_eos=True, logprobs=2, repetition_penalty=1.3, frequency_penalty=0.2)
        for i in range(len(PROMPTS))
    ]
    tokens, logprobs, engine = run(target, params, draft=model(5))
    assert engine.spec_stats is not None and engine.spec_stats.num_accepted_tokens > 0
    for toks, lps in zip(tokens, logprobs, strict=True):
        assert len(toks) == len(lps) == MAX
        assert [lp.token_id for lp in lps] == toks and all(lp.logprob <= 0 and len(lp.top) == 2 for lp in lps)

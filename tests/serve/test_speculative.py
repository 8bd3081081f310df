"""Speculative decoding on the hybrid cache (serve/speculative.py, serve/draft.py) on the real K3 debug model, fp32: greedy
output equals non-speculative decoding token for token (several prompts, batch > 1, chunked prefill, prefix caching, a
draft that agrees and one that mostly does not, so rollbacks happen), stop tokens and max_tokens inside an accepted run end
it there, and the rejection rule leaves the target distribution unchanged (a seeded statistical test)."""

from collections import Counter
from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.model import K3ForCausalLM
from openk3.serve import runner as runner_module
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.sampling import SamplingParams
from openk3.serve.spec_states import stepwise_verification
from openk3.serve.speculative import SpeculativeConfig, verify
from openk3.serve.tokenizer import ByteTokenizer

BASE: dict[str, Any] = dict(page_size=4, num_pages=200, max_num_seqs=4, max_model_len=256, long_prefill_token_threshold=16)
PROMPTS = [list(range(40, 70)), list(range(40, 70)) + [9, 8, 7], [5, 6, 7, 8] * 5, [100, 3, 77]]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def model(seed: int) -> K3ForCausalLM:
    m = K3ForCausalLM(debug())
    m.init_weights(seed=seed)
    return m.eval()


@pytest.fixture(scope="module")
def target() -> K3ForCausalLM:
    return model(5)


def run(target, params: list[SamplingParams], draft=None, k: int = 3, prompts=PROMPTS, **cfg) -> tuple[list[list[int]], LLMEngine]:
    config = EngineConfig(**{**BASE, **cfg})
    engine = LLMEngine(target, ByteTokenizer(256), config, draft_model=draft, speculative=SpeculativeConfig(k) if draft else None)
    out: dict[str, list[int]] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
        out[str(i)] = []
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        engine.check_integrity()
    return [out[str(i)] for i in range(len(prompts))], engine


GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


@pytest.fixture
def forms(monkeypatch) -> Counter[str]:
    """How many steps verified drafts in the stepwise form (per-position KDA states) and in the chunked form (the fallback
    of a step that also prefills: snapshot and recompute)."""
    seen: Counter[str] = Counter()

    def counted(out, batch, verifying, cache):  # type: ignore[no-untyped-def]
        got = stepwise_verification(out, batch, verifying, cache)
        if verifying:
            seen["stepwise" if got is not None else "chunked"] += 1
        return got

    monkeypatch.setattr(runner_module, "stepwise_verification", counted)
    return seen


@pytest.mark.parametrize("draft_seed", [5, 11])
@pytest.mark.parametrize("prefix", [False, True])
def test_greedy_equals_plain_decoding(target, draft_seed, prefix, forms) -> None:
    cfg = dict(enable_prefix_caching=True, prefix_match_unit=8) if prefix else {}
    params = [GREEDY] * len(PROMPTS)
    plain, _ = run(target, params, **cfg)
    spec, engine = run(target, params, draft=model(draft_seed), **cfg)
    assert spec == plain
    assert forms["stepwise"] > 0 and forms["chunked"] > 0  # prompts still prefilling beside verifications take the fallback
    stats = engine.spec_stats
    assert stats is not None and stats.num_draft_tokens > 0
    if draft_seed == 5:  # the draft is the target: every draft is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # rollbacks happened


@pytest.mark.parametrize("prefix", [False, True])
def test_greedy_equals_plain_decoding_across_batch_mixes(target, prefix, forms) -> None:
    """Twelve prompts through 4 slots (admissions beside verifications), every third asking for logprobs and for
    min_tokens=4 (it decodes one token a step beside the speculating ones in a stepwise step until 4 tokens are out),
    repeated prefixes for the prefix cache, k = 2 and 4."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, 255, (int(n),), generator=g).tolist() for n in torch.randint(3, 40, (12,), generator=g)]
    prompts[5], prompts[9] = prompts[1] + [4, 4], list(prompts[1])
    params = [GREEDY.replace(max_tokens=6 + i % 9, logprobs=1, min_tokens=4) if i % 3 == 2 else GREEDY.replace(max_tokens=6 + i % 9) for i in range(12)]
    cfg = dict(enable_prefix_caching=True, prefix_match_unit=8) if prefix else {}
    plain, _ = run(target, params, prompts=prompts, **cfg)
    for k in (2, 4):
        spec, engine = run(target, params, draft=model(11), k=k, prompts=prompts, **cfg)
        assert spec == plain
        assert engine.spec_stats is not None and 0 < engine.spec_stats.num_accepted_tokens < engine.spec_stats.num_draft_tokens
    assert forms["stepwise"] > 0 and forms["chunked"] > 0


def test_greedy_equals_plain_decoding_with_preemption_and_a_tight_budget(target) -> None:
    cfg = dict(num_pages=20, max_num_batched_tokens=10, max_model_len=80)
    params = [GREEDY] * len(PROMPTS)
    plain, _ = run(target, params, **cfg)
    spec, engine = run(target, params, draft=model(11), **cfg)
    assert spec == plain
    assert engine.scheduler.num_preemptions_total > 0
    assert engine.spec_stats is not None and engine.spec_stats.num_drafts > 0


def test_stop_token_and_max_tokens_inside_an_accepted_run(target) -> None:
    plain, _ = run(target, [GREEDY], prompts=PROMPTS[:1])
    tokens = plain[0]
    stop = tokens[5]
    first = tokens.index(stop)
    for p in (GREEDY.replace(stop_token_ids=[stop]), GREEDY.replace(max_tokens=first + 1)):
        want, _ = run(target, [p], prompts=PROMPTS[:1])
        got, engine = run(target, [p], draft=model(5), k=4, prompts=PROMPTS[:1])
        assert got == want and len(got[0]) == first + 1
        assert engine.spec_stats is not None and engine.spec_stats.num_accepted_tokens > 0


def test_sampled_requests_run_and_mix_with_greedy(target) -> None:
    params = [SamplingParams(temperature=0.8, max_tokens=10, seed=i, ignore_eos=True) for i in range(2)] + [GREEDY, GREEDY]
    plain, _ = run(target, params)
    spec, engine = run(target, params, draft=model(5))
    assert spec[2:] == plain[2:]
    assert [len(s) for s in spec] == [10, 10, 14, 14]
    assert engine.spec_stats is not None and engine.spec_stats.num_drafts > 0


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.1, 0.1, 0.4, 0.4], [0.4, 0.3, 0.2, 0.1]])
    logits = p.log()
    params = SamplingParams(temperature=1.0)
    trials = 20000
    first = torch.zeros(4)
    second = torch.zeros(4)
    drafts_all = torch.stack([torch.multinomial(q[i], trials, replacement=True, generator=gen) for i in range(2)], 1).tolist()
    for drafts in drafts_all:
        out, accepted = verify(logits, drafts, q, params, gen)
        assert len(out) == accepted + 1 and out[:accepted] == drafts[:accepted]
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    assert torch.allclose(first / trials, p[0], atol=0.012)
    assert torch.allclose(second / second.sum(), p[1], atol=0.02)


def cache_of(engine: LLMEngine, rid: str, n: int) -> list[torch.Tensor]:
    """Request rid's KDA states and conv windows, and its MLA latents of positions 0..n-1."""
    t, cache = engine.cache.tensors, engine.cache
    slot, pages = cache.slot(rid), cache.page_ids(rid)
    rows = [(pages[q // cache.page_size], q % cache.page_size) for q in range(n)]
    latents = [torch.stack([layer[p, o] for p, o in rows]) for layer in t.mla_latent]
    return [pool[slot].clone() for pool in (*t.kda_state, *t.conv_state)] + latents


def test_a_rollback_leaves_the_cache_of_the_kept_tokens(target) -> None:
    engine = LLMEngine(target, ByteTokenizer(256), EngineConfig(**BASE), draft_model=model(11), speculative=SpeculativeConfig(4))
    engine.add_request("0", PROMPTS[0], GREEDY)
    stats = engine.spec_stats
    assert stats is not None
    while stats.num_accepted_tokens == stats.num_draft_tokens or stats.num_drafts < 2:
        engine.step()
    req = engine.scheduler.requests["0"]
    c = req.num_computed_tokens
    assert c == req.num_tokens - 1
    got = cache_of(engine, "0", c)
    plain = LLMEngine(target, ByteTokenizer(256), EngineConfig(**BASE))
    plain.add_request("p", req.token_ids[:c], GREEDY.replace(max_tokens=2))
    while plain.scheduler.requests["p"].num_computed_tokens < c:
        plain.step()
    want = cache_of(plain, "p", c)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def run_text(target, params: SamplingParams, draft=None) -> tuple[list[int], str, str | None]:
    engine = LLMEngine(target, ByteTokenizer(256), EngineConfig(**BASE), draft_model=draft, speculative=SpeculativeConfig(4) if draft else None)
    engine.add_request("0", PROMPTS[0], params)
    tokens: list[int] = []
    text, reason = "", None
    while engine.has_unfinished():
        for o in engine.step():
            tokens.extend(o.new_token_ids)
            text = text[: len(text) - o.text_dropped] + o.new_text
            reason = o.finish_reason
        engine.check_integrity()
    return tokens, text, reason


def test_a_stop_string_inside_an_accepted_run_ends_it_there(target) -> None:
    tokens, text, _ = run_text(target, GREEDY)
    stop = ByteTokenizer(256).decode(tokens[5:7])
    assert stop and stop in text
    params = GREEDY.replace(stop=[stop])
    want = run_text(target, params)
    got = run_text(target, params, draft=model(5))
    assert got == want and want[2] == "stop" and len(want[0]) < len(tokens)

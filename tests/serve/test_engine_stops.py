"""Stop strings, stop tokens, EOS, max/min tokens, seeds and n, with vLLM's semantics."""

import pytest
import torch

from openk3.llm import LLM, Prompt
from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.output import OutputKind, OutputProcessor, find_stop_string
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer
from tests.serve.serve_fakes import FakeModel, ScriptedModel

TEXT = "Hello, world! Stop here: caf\u00e9 \u20ac done."
EOS = 257  # ByteTokenizer(260): 256 bos, 257 eos, 258 pad
SCRIPT = list(TEXT.encode()) + [EOS] + list(b"after eos")
PROMPT = SCRIPT[:2]  # "He"


def generate(params: SamplingParams, script=SCRIPT, prompt=PROMPT, **cfg):
    llm = LLM(ScriptedModel(script), ByteTokenizer(260), num_pages=64, page_size=4, max_num_seqs=4, **cfg)
    out = llm.generate([prompt], params)[0]
    llm.engine.check_integrity()
    return out.outputs[0]


def test_max_tokens_is_length() -> None:
    c = generate(SamplingParams(temperature=0, max_tokens=3))
    assert (c.text, c.finish_reason, len(c.token_ids)) == ("llo", "length", 3)


def test_stop_string_is_cut_from_text() -> None:
    c = generate(SamplingParams(temperature=0, max_tokens=50, stop=("world",)))
    assert (c.text, c.finish_reason, c.stop_reason) == ("llo, ", "stop", "world")
    assert bytes(c.token_ids).decode() == "llo, world"  # tokens up to the one that completed the stop string
    c = generate(SamplingParams(temperature=0, max_tokens=50, stop=("world",), include_stop_str_in_output=True))
    assert c.text == "llo, world"


def test_stop_string_over_multibyte_characters_and_order() -> None:
    c = generate(SamplingParams(temperature=0, max_tokens=50, stop=("\u20ac", "caf\u00e9")))
    assert (c.text, c.stop_reason) == ("llo, world! Stop here: ", "caf\u00e9")
    c = generate(SamplingParams(temperature=0, max_tokens=50, stop=("\u00e9 \u20ac",)))
    assert c.text == "llo, world! Stop here: caf"


def test_stop_string_beats_length_on_the_same_token() -> None:
    c = generate(SamplingParams(temperature=0, max_tokens=len("llo, world"), stop=("world",)))
    assert (c.text, c.finish_reason) == ("llo, ", "stop")


def test_stop_token_ids_and_eos() -> None:
    c = generate(SamplingParams(temperature=0, max_tokens=50, stop_token_ids=(ord("!"),)))
    assert (c.text, c.finish_reason, c.stop_reason) == ("llo, world", "stop", ord("!"))
    assert c.token_ids[-1] == ord("!")  # the stop token is in the ids but not in the text
    c = generate(SamplingParams(temperature=0, max_tokens=100))
    assert (c.text, c.finish_reason, c.stop_reason, c.token_ids[-1]) == (TEXT[2:], "stop", None, EOS)
    c = generate(SamplingParams(temperature=0, max_tokens=len(TEXT.encode()) - 2 + 1 + 3, ignore_eos=True))
    assert c.finish_reason == "length" and c.text == TEXT[2:] + "aft" and EOS in c.token_ids


def test_min_tokens_masks_stop_tokens_and_delays_stop_strings() -> None:
    c = generate(SamplingParams(temperature=0, max_tokens=50, stop_token_ids=(ord("o"),), min_tokens=2))
    assert c.text == "ll"  # 'o' comes 3rd, after min_tokens: it stops
    c = generate(SamplingParams(temperature=0, max_tokens=50, stop_token_ids=(ord("o"),), min_tokens=3))
    # 'o' masked while fewer than 3 tokens are out: the best other token (id 0) takes its place; the next 'o' stops
    assert c.text == "ll\x00, w" and c.stop_reason == ord("o")
    c = generate(SamplingParams(temperature=0, max_tokens=50, stop=("l",), min_tokens=2))
    assert c.text == "llo, wor"  # stop strings are looked for only in text produced after min_tokens


def test_max_model_len_is_length() -> None:
    c = generate(SamplingParams(temperature=0, max_tokens=None), max_model_len=8)
    assert (c.text, c.finish_reason) == ("llo, w", "length")


def test_find_stop_string_looks_only_at_new_text() -> None:
    assert find_stop_string("abcx", 1, ("ab",), False) is None  # "ab" lies wholly in text already checked
    assert find_stop_string("abcab", 1, ("ab",), False) == ("ab", 3)
    assert find_stop_string("abcab", 2, ("ab",), False) == ("ab", 3)
    assert find_stop_string("abcab", 2, ("ab",), True) == ("ab", 5)


def sampled(params, prompts, seed=0):
    llm = LLM(FakeModel(), ByteTokenizer(256), num_pages=64, page_size=4, max_num_seqs=8, seed=seed)
    return llm.generate(prompts, params)


def test_seeds_reproduce_and_do_not_depend_on_the_batch() -> None:
    p = SamplingParams(temperature=1.0, max_tokens=12, seed=42)
    alone = sampled(p, [[1, 2, 3]])[0].token_ids
    crowd = sampled([SamplingParams(temperature=1.0, max_tokens=12), p, SamplingParams(temperature=0.7, max_tokens=5)], [[9], [1, 2, 3], [4, 4]], seed=7)
    assert crowd[1].token_ids == alone
    other = sampled(SamplingParams(temperature=1.0, max_tokens=12, seed=43), [[1, 2, 3]])[0].token_ids
    assert other != alone
    assert len(set(alone)) > 1  # really sampled, not greedy


def test_unseeded_requests_follow_the_engine_seed() -> None:
    p = SamplingParams(temperature=1.0, max_tokens=10)
    assert sampled(p, [[5, 6]], seed=1)[0].token_ids == sampled(p, [[5, 6]], seed=1)[0].token_ids
    assert sampled(p, [[5, 6]], seed=1)[0].token_ids != sampled(p, [[5, 6]], seed=2)[0].token_ids


def test_n_samples_use_seed_plus_index() -> None:
    out = sampled(SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=10), [[1, 2]])[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and all(c.metrics is not None for c in out.outputs)
    for i, c in enumerate(out.outputs):
        assert c.token_ids == sampled(SamplingParams(temperature=1.0, max_tokens=8, seed=10 + i), [[1, 2]])[0].token_ids


def test_logprobs_and_timings() -> None:
    out = sampled(SamplingParams(temperature=0, max_tokens=4, logprobs=3), [[1, 2]])[0]
    c, m = out.outputs[0], out.outputs[0].metrics
    assert c.logprobs is not None and m is not None
    assert len(c.logprobs) == 4 and all(lp.token_id == t and len(lp.top) == 3 for lp, t in zip(c.logprobs, c.token_ids, strict=True))
    assert all(lp.top[0][0] == lp.token_id for lp in c.logprobs)  # greedy: the sampled token is the top one
    assert 0 <= m.queue_time <= m.time_to_first_token <= m.e2e_latency
    assert (m.num_prompt_tokens, m.num_output_tokens) == (2, 4)
    assert m.time_per_output_token == pytest.approx((m.e2e_latency - m.time_to_first_token) / 3)


def test_string_prompts_and_abort_on_error() -> None:
    llm = LLM(ScriptedModel([256] + SCRIPT), ByteTokenizer(260), num_pages=64, page_size=4)
    out = llm.generate("He", SamplingParams(temperature=0, max_tokens=3))
    assert out[0].prompt_token_ids == (256, ord("H"), ord("e"))  # text gets the BOS token, as in vLLM
    assert out[0].prompt == "He" and out[0].text == "llo"
    with pytest.raises(ValueError, match="sampling_params has 2 entries for 1 prompts"):
        llm.generate(["He"], [SamplingParams(), SamplingParams()])
    with pytest.raises(ValueError, match="prompt is empty"):
        prompts: list[Prompt] = ["He", []]
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()  # the first prompt of the failed call was aborted
    llm.engine.check_integrity()


def test_engine_refuses_duplicate_ids() -> None:
    eng = LLMEngine(FakeModel(), ByteTokenizer(256), EngineConfig(num_pages=16, page_size=4, max_num_seqs=2))
    eng.add_request("a", [1])
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a", [2])
    eng.abort("a")
    eng.check_integrity()
    assert torch.equal(torch.tensor(eng.cache.num_free_pages), torch.tensor(16))


def test_streamed_text_never_shows_a_stop_string_prefix() -> None:
    eng = LLMEngine(ScriptedModel(SCRIPT), ByteTokenizer(260), EngineConfig(num_pages=64, page_size=4, max_num_seqs=2))
    processor = OutputProcessor(eng)
    processor.add_request("s", PROMPT, SamplingParams(temperature=0, max_tokens=50, stop=("world!",)), OutputKind.DELTA)
    seen, text = [], ""
    while eng.has_unfinished():
        for out in processor.process(eng.step()):
            text += out.outputs[0].text  # the deltas put together: what a stream has shown so far
            seen.append((text, out.finished))
    for text, finished in seen:
        assert "w" not in text  # "w" starts the stop string: it must not be streamed before the stop is decided
        if not finished:
            assert "llo, world!".startswith(text)
    assert seen[-1] == ("llo, ", True)
    assert [t for t, _ in seen[:5]] == ["", "", "", "", ""]  # the first 5 characters are held back (len("world!") - 1)
    assert seen[5][0] == "l"

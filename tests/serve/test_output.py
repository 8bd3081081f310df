"""OutputProcessor: streamed deltas add up to the whole text, hold-back is applied once (and not with
include_stop_str_in_output), n samples regroup, aborts report, and the engine core reports only new tokens."""

from __future__ import annotations

import pytest

from openk3.serve.engine import EngineConfig, LLMEngine
from openk3.serve.output import IterationStats, OutputKind, OutputProcessor, RequestOutput
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer
from tests.serve.serve_fakes import FakeModel, ScriptedModel

TEXT = "Hello, world! Stop here: caf\u00e9 \u20ac done."
EOS = 257
SCRIPT = list(TEXT.encode()) + [EOS]
PROMPT = SCRIPT[:2]


def engine(model=None) -> LLMEngine:
    return LLMEngine(model or ScriptedModel(SCRIPT), ByteTokenizer(260), EngineConfig(num_pages=64, page_size=4, max_num_seqs=8))


def run(processor: OutputProcessor, stats: IterationStats | None = None) -> list[RequestOutput]:
    outs = []
    while processor.engine.has_unfinished():
        outs.extend(processor.process(processor.engine.step(), stats))
    processor.engine.check_integrity()
    return outs


@pytest.mark.parametrize(
    "stop, include",
    [((), False), (("world",), False), (("world",), True), (("\u20ac", "caf\u00e9"), False), (("\u00e9 \u20ac",), False), (("!",), True)],
)
def test_deltas_add_up_to_the_final_text(stop, include) -> None:
    params = SamplingParams(temperature=0, max_tokens=60, stop=stop, include_stop_str_in_output=include)
    streamed, whole = OutputProcessor(engine()), OutputProcessor(engine())
    streamed.add_request("r", PROMPT, params, OutputKind.DELTA)
    whole.add_request("r", PROMPT, params, OutputKind.FINAL_ONLY)
    deltas = run(streamed)
    (final,) = run(whole)
    c = final.outputs[0]
    assert "".join(d.outputs[0].text for d in deltas) == c.text
    assert tuple(t for d in deltas for t in d.token_ids) == c.token_ids
    assert (deltas[-1].outputs[0].finish_reason, deltas[-1].outputs[0].stop_reason) == (c.finish_reason, c.stop_reason)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]


def test_hold_back_is_the_longest_stop_minus_one_and_none_when_the_stop_is_kept() -> None:
    def lag(include: bool) -> list[int]:
        p = OutputProcessor(engine())
        p.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=60, stop=("world!",), include_stop_str_in_output=include), OutputKind.DELTA)
        sent, lags = 0, []
        for i, out in enumerate(run(p)):
            sent += len(out.outputs[0].text)
            if not out.finished:
                lags.append(i + 1 - sent)  # one character per byte token here
        return lags

    assert set(lag(include=False)[5:]) == {5}  # len("world!") - 1, applied once
    assert set(lag(include=True)) == {0}


def test_n_samples_regroup_in_index_order_and_reuse_the_prompt_tuple() -> None:
    p = OutputProcessor(engine(FakeModel()))
    ids = p.add_request("r", [1, 2, 3], SamplingParams(n=3, temperature=1.0, max_tokens=5, seed=4), OutputKind.DELTA)
    assert ids == ["r-0", "r-1", "r-2"]
    assert {p.engine.scheduler.requests[i].group for i in ids} == {"r"}  # the scheduler shares slots by the caller's request
    p.add_request("single", [1, 2], SamplingParams(max_tokens=2))
    assert p.engine.scheduler.requests["single"].group == "single"
    outs = [out for out in run(p) if out.request_id == "r"]
    assert all(out.request_id == "r" for out in outs)
    assert all([c.index for c in out.outputs] == sorted(c.index for c in out.outputs) for out in outs)
    assert len({id(out.prompt_token_ids) for out in outs}) == 1  # made once, not copied per step
    assert outs[-1].finished and not p.num_unfinished


def test_the_core_reports_only_the_new_token() -> None:
    eng = engine()
    eng.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=10))
    seen = []
    while eng.has_unfinished():
        seen.extend(eng.step())
    assert all(len(o.new_token_ids) == 1 for o in seen)
    assert [t for o in seen for t in o.new_token_ids] == SCRIPT[2:12]
    assert [o.finish_reason for o in seen] == [None] * 9 + ["length"] and seen[-1].metrics is not None


def test_a_stop_string_finishes_the_core_request_and_counts_as_stop() -> None:
    p = OutputProcessor(engine())
    p.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=60, stop=("world",)), OutputKind.FINAL_ONLY)
    stats = IterationStats()
    (out,) = run(p, stats)
    c = out.outputs[0]
    assert (c.text, c.finish_reason, c.stop_reason) == ("llo, ", "stop", "world")
    assert c.metrics is not None and c.metrics.num_output_tokens == len("llo, world")
    assert not p.engine.has_unfinished()  # the core request ended with the stop string, not at max_tokens
    assert [f.finish_reason for f in stats.finished] == ["stop"] and stats.prompts == [(2, 0)]
    assert len(stats.inter_token_latencies) == len("llo, world") - 1


def test_abort_ends_every_running_sample_and_frees_the_engine() -> None:
    p = OutputProcessor(engine(FakeModel()))
    p.add_request("r", [1, 2], SamplingParams(n=2, temperature=0, max_tokens=50), OutputKind.FINAL_ONLY)
    p.process(p.engine.step())
    out = p.abort("r")
    assert out is not None and out.finished and [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert p.abort("r") is None and not p.engine.has_unfinished()
    p.engine.check_integrity()


def test_a_refused_prompt_leaves_nothing_queued() -> None:
    p = OutputProcessor(engine())
    with pytest.raises(ValueError, match="maximum context length is 256 tokens"):
        p.add_request("r", list(range(10)) * 100, SamplingParams(n=2))
    assert not p.engine.has_unfinished() and "r" not in p
    with pytest.raises(ValueError, match="one sample per request"):
        p.engine.add_request("x", [1], SamplingParams(n=2))


def test_an_aborted_stream_keeps_its_held_back_text_unsent() -> None:
    p = OutputProcessor(engine())
    p.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=60, stop=("world!",)), OutputKind.DELTA)
    sent = ""
    for _ in range(8):
        for out in p.process(p.engine.step()):
            sent += out.outputs[0].text
    last = p.abort("r")
    assert last is not None and last.outputs[0].finish_reason == "abort" and last.outputs[0].text == ""
    assert sent == "llo"  # 8 characters out, len("world!") - 1 = 5 of them held back, and still held at the abort

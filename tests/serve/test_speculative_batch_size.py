"""vLLM's `disable_by_batch_size` (SpeculativeConfig, EngineConfig.speculative_disable_by_batch_size, the
`--speculative-config` key): no request gets drafts in a step that begins with that many running requests or more; below
it speculation resumes; output is unchanged either way. Its spellings, and what is refused by name."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from openk3.cli import build_parser
from openk3.launch.server import server_configs
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.serve.config import EngineConfig
from openk3.serve.engine import LLMEngine
from openk3.serve.sampling import SamplingParams
from openk3.serve.speculative import SpeculativeConfig
from openk3.serve.tokenizer import ByteTokenizer
from tests.serve.test_speculative import model

BASE: dict[str, Any] = dict(page_size=4, num_pages=200, max_num_seqs=4, max_model_len=256)
PROMPTS = [[40, 41, 42], [7, 8, 9, 10], [100, 3, 77], [5, 6] * 4]
LENGTHS = [3, 6, 10, 20]  # requests finish one after another: the running batch shrinks from 4 to 1


@pytest.fixture(scope="module")
def target() -> K3ForCausalLM:
    torch.set_num_threads(1)
    return model(5)


def run(target, spec: SpeculativeConfig | None) -> tuple[list[list[int]], list[tuple[int, int]], LLMEngine]:
    """Outputs, and per step (running requests when it began, requests given drafts)."""
    engine = LLMEngine(target, ByteTokenizer(256), EngineConfig(**BASE), draft_model=model(5) if spec else None, speculative=spec)
    out: dict[str, list[int]] = {}
    for i, (prompt, n) in enumerate(zip(PROMPTS, LENGTHS, strict=True)):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        out[str(i)] = []
    steps = []
    schedule = engine.scheduler.schedule

    def observed():  # type: ignore[no-untyped-def]
        # drafts are proposed before the step is planned: what the running requests hold now is what the step verifies
        steps.append((engine.scheduler.num_running, sum(1 for r in engine.scheduler.running if r.draft_token_ids)))
        return schedule()

    engine.scheduler.schedule = observed  # type: ignore[method-assign]
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[str(i)] for i in range(len(PROMPTS))], steps, engine


def test_no_drafts_in_a_step_that_begins_with_that_many_running(target) -> None:
    plain, _, _ = run(target, None)
    always, steps_always, _ = run(target, SpeculativeConfig(3))
    limited, steps, engine = run(target, SpeculativeConfig(3, disable_by_batch_size=3))
    assert limited == always == plain
    assert any(running >= 3 and drafted for running, drafted in steps_always)  # without the key those steps speculate
    assert all(drafted == 0 for running, drafted in steps if running >= 3)
    assert any(drafted for running, drafted in steps if running < 3)  # below it, speculation resumes
    stats = engine.spec_stats
    assert stats is not None and stats.num_drafts > 0


def test_its_spellings_and_refusals() -> None:
    def serve(config: str) -> EngineConfig:
        engine, _ = server_configs(build_parser().parse_args(["serve", "--speculative-config", config]))
        return engine

    assert serve('{"model": "tiny", "disable_by_batch_size": 4}').speculative_disable_by_batch_size == 4
    assert serve('{"method": "mtp", "disable_by_batch_size": 8}').speculative_disable_by_batch_size == 8
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size=4 needs speculative decoding"):
        EngineConfig(speculative_disable_by_batch_size=4)
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
        serve('{"model": "tiny", "disable_by_batch_size": 1}')
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig(2, disable_by_batch_size=0)
    with LLM("tiny", speculative_model="tiny", num_speculative_tokens=2, speculative_disable_by_batch_size=2, max_num_seqs=2) as llm:
        greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        outs = llm.generate(["In the beginning", "And God said"], greedy)
        stats = llm.engine.spec_stats
    assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
    assert stats is not None and stats.num_drafts == 0  # two running from the first decode step to the last


def test_the_mtp_layer_sits_out_steps_without_drafts_and_starts_over_after() -> None:
    """With the shipped MTP layer: steps without drafts do not run the layer either; once the batch shrinks below the key,
    the layer starts over at the rows it is given and drafts again. Output equals plain decoding's."""
    settings: dict[str, Any] = dict(max_num_seqs=4, max_model_len=256, num_pages=64, page_size=16)
    prompts = ["In the beginning", "And God said", "The LORD is my shepherd"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 8, 30)]
    with LLM("tiny", **settings) as plain:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    with LLM("tiny", speculative_method="mtp", num_speculative_tokens=2, speculative_disable_by_batch_size=2, **settings) as spec:
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
        stats = spec.engine.spec_stats
    assert got == want
    assert stats is not None and 0 < stats.num_drafts < 30  # only the last request, alone, speculates

"""The engine on the real K3 model (debug preset, fp32): batching, chunking and preemption never change greedy tokens."""

from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

NEW = 8


def packed(model) -> bool:
    """The serving layout kept oneDNN copies of the model's projections (serve/prepare.py)."""
    from openk3.serve.prepare import PackedLinear

    return any(isinstance(m, PackedLinear) for m in model.modules())


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    m = K3ForCausalLM(debug())
    m.init_weights(seed=3)
    return m.eval()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 23, 1, 12)]


def uncached_greedy(model, prompt: list[int]) -> list[int]:
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(NEW):
            tokens.append(int(model.forward_tokens(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(prompt) :]


def run(model, prompts, **cfg) -> list[list[int]]:
    base: dict[str, Any] = dict(num_pages=48, page_size=4, max_num_seqs=4, max_model_len=64)
    base.update(cfg)
    llm = LLM(model, ByteTokenizer(256), **base)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW))
    llm.engine.check_integrity()
    return [list(o.token_ids) for o in outs]


@pytest.fixture(scope="module")
def separate(model, prompts) -> list[list[int]]:
    return [run(model, [p])[0] for p in prompts]


def test_separate_runs_match_uncached_forward(model, prompts, separate) -> None:
    assert separate == [uncached_greedy(model, p) for p in prompts]


def test_batch_gives_the_tokens_of_separate_runs(model, prompts, separate) -> None:
    assert run(model, prompts) == separate


@pytest.mark.parametrize("chunk, budget", [(1, 64), (3, 64), (7, 10), (None, 6)])
def test_chunked_prefill_matches_one_shot(model, prompts, separate, chunk, budget) -> None:
    assert run(model, prompts, long_prefill_token_threshold=chunk, max_num_batched_tokens=budget) == separate


def test_preemption_recomputes_exactly(model, prompts, separate) -> None:
    llm = LLM(model, ByteTokenizer(256), num_pages=12, page_size=4, max_num_seqs=4, max_model_len=40)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW))
    assert llm.engine.scheduler.num_preemptions_total > 0
    assert [list(o.token_ids) for o in outs] == separate


def test_llm_debug_preset_warns_and_generates() -> None:
    with pytest.warns(UserWarning, match="random weights"):
        llm = LLM("debug", num_pages=32, page_size=8, max_num_seqs=2)
    prompts: list[str | list[int]] = ["hi", [1, 2, 3]]
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4))
    assert [len(o.token_ids) for o in out] == [4, 4] and out[0].prompt == "hi"
    # a model LLM loads itself is the engine's alone: its projections may be packed for CPU; a module passed in is not
    assert llm.engine.config.pack_cpu_weights and packed(llm.engine.model)


def test_cpu_weight_packing_only_for_models_the_engine_owns(monkeypatch: pytest.MonkeyPatch) -> None:
    module = K3ForCausalLM(debug())
    assert not LLM(module, ByteTokenizer(256), num_pages=32, page_size=8).engine.config.pack_cpu_weights
    assert not packed(module)
    assert packed(LLM(module, ByteTokenizer(256), num_pages=32, page_size=8, pack_cpu_weights=True).engine.model)
    with pytest.warns(UserWarning, match="random weights"):
        assert not packed(LLM("debug", num_pages=32, page_size=8, pack_cpu_weights=False).engine.model)

    import openk3.serve.engine as engine_mod
    from openk3.cli import build_parser
    from openk3.launch.server import build_server

    seen: list[bool] = []
    real = engine_mod.LLMEngine.__init__

    def spy(self, model, tokenizer, config=None, *rest, **named) -> None:  # type: ignore[no-untyped-def]
        seen.append(config.pack_cpu_weights)
        real(self, model, tokenizer, config, *rest, **named)

    monkeypatch.setattr(engine_mod.LLMEngine, "__init__", spy)
    for flags in ([], ["--no-cpu-weight-packing"]):
        args = build_parser().parse_args(["serve", "--model", "debug", "--cache-memory-mb", "4", *flags])
        with pytest.warns(UserWarning, match="random weights"):
            build_server(args)
    assert seen == [True, False]  # the server owns its model: packed unless told not to


def test_packed_engine_built_and_run_under_inference_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights made under inference mode have no version counter: they are served unpacked instead of failing."""
    from openk3.ops import linear as linear_mod

    monkeypatch.setattr(linear_mod, "LARGE_WEIGHT", 2**10)  # the debug model's projections are below the real threshold
    with torch.inference_mode(), pytest.warns(UserWarning, match="random weights"):
        llm = LLM("debug", num_pages=32, page_size=8, max_num_seqs=2)
        out = llm.generate([list(range(10, 49))], SamplingParams(temperature=0, max_tokens=3))  # 39 rows: above the kernel's
    assert packed(llm.engine.model) and len(out[0].token_ids) == 3
    with pytest.raises(ValueError, match="neither a preset"):
        LLM("/no/such/model")

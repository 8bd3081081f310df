"""Data-parallel attention with expert parallelism (`LLM(dp=2, ep=2)`): every rank runs an engine of its own over the
requests rank 0 places on it, the MoE layers exchange tokens across the ranks, and the tokens equal one process's,
with the prefix cache on and with stop strings that rank 0 applies to a remote rank's request."""

from __future__ import annotations

import warnings

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.model.batch import CacheTensors, ForwardBatch
from openk3.parallel.config import ParallelConfig
from openk3.parallel.dp.engine import DataParallelEngine
from openk3.parallel.dp.lockstep import LockstepModel
from openk3.parallel.dp.router import DPRouter
from openk3.serve.sampling import SamplingParams

SHARED = [9] * 70  # two prompts share their first 64-token match unit: one rank's prefix cache serves both
PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [200, 1, 1, 7], list(range(30, 70)), SHARED, [*SHARED, 3]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)


def generate(dp: int = 1, prefix: bool = False, tp: int = 1) -> tuple[list[list[list[int]]], list[int]]:
    """Greedy and seeded tokens for PROMPTS, and the prompt tokens each DP rank received."""
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the preset's "random weights" warning
        with LLM("debug", max_num_batched_tokens=16, dp=dp, tp=tp, ep=dp * tp, enable_prefix_caching=prefix) as llm:
            tokens = [[list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, p)] for p in (GREEDY, SEEDED)]
            engine = llm.core
            if not isinstance(engine, DataParallelEngine):
                return tokens, []
            received = [s.prompt_tokens_total for s in engine.rank_stats()]
            merged = engine.stats()  # what the server's /metrics reads: every rank's stats summed
            assert merged.prompt_tokens_total == sum(received) and merged.num_state_slots == dp * llm.engine.stats().num_state_slots
            return tokens, received


@pytest.fixture(scope="module")
def single_process() -> list[list[list[int]]]:
    return generate()[0]


@pytest.mark.distributed
@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_dp2_ep2_tokens_equal_single_process(prefix: bool, single_process: list[list[list[int]]]) -> None:
    got, received = generate(dp=2, prefix=prefix)
    assert got[0] == single_process[0], "greedy"
    assert got[1] == single_process[1], "seeded sampling (per-request generators)"
    assert all(n > 0 for n in received), f"both ranks served requests: {received}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("prefix", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_dp2_tp2_ep4_tokens_equal_single_process(prefix: bool, single_process: list[list[list[int]]]) -> None:
    """Tensor parallelism inside each DP group: 4 ranks, each DP group's leader drives its TP rank."""
    got, received = generate(dp=2, tp=2, prefix=prefix)
    assert got[0] == single_process[0], "greedy"
    assert got[1] == single_process[1], "seeded sampling (per-request generators)"
    assert len(received) == 2 and all(n > 0 for n in received), f"both DP groups served requests: {received}"


@pytest.mark.distributed
def test_dp2_a_remote_request_ended_before_its_first_step_is_never_sent() -> None:
    """A request placed on rank 1 and aborted before the next step (a client gone at once, behind `openk3 serve --dp`)
    leaves nothing to send, and the group keeps serving."""
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM("debug", dp=2, ep=2) as llm:
            engine = llm.core
            assert isinstance(engine, DataParallelEngine)
            engine.add_request("home", [5, 6, 7], GREEDY)  # the least-loaded rule: rank 0, then rank 1
            engine.add_request("gone", [8, 9, 10], GREEDY)
            assert engine.router.rank_of("gone") == 1
            engine.abort("gone")
            assert engine.was_scheduled("gone") is None
            tokens: list[int] = []
            while engine.has_unfinished():
                tokens += [t for out in engine.step() for t in out.new_token_ids if out.request_id == "home"]
            assert len(tokens) == GREEDY.max_tokens
            assert [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0]], GREEDY)]  # still serving


@pytest.mark.distributed
def test_dp2_stop_strings_end_remote_requests_as_one_process_does() -> None:
    torch.set_num_threads(1)
    prompts = ["And God said", "In the beginning", "Once upon a time"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM("debug") as llm:
            free = [o.outputs[0].text for o in llm.generate(prompts, GREEDY)]
        # a stop string from the middle of each greedy text: every request ends on a stop string rank 0 finds
        params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=(text[3:5],)) for text in free]
        with LLM("debug") as llm:
            want = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]
        with LLM("debug", dp=2, ep=2) as llm:
            got = [(o.outputs[0].text, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)]
            assert not llm.core.has_unfinished()
    assert got == want and all(reason == "stop" for _, reason in got)


def test_router_keeps_a_prefix_home_and_balances_the_rest() -> None:
    router = DPRouter(2, match_unit=4, max_imbalance_tokens=10)
    assert router.place("a", [1, 2, 3, 4, 5], max_tokens=5) == 0  # least loaded (tie: lowest rank)
    assert router.place("b", [7, 7], max_tokens=1) == 1  # least loaded
    assert router.place("c", [1, 2, 3, 4, 9], max_tokens=1) == 0  # the prefix's home, within the imbalance bound
    assert router.load == [16, 3]
    assert router.place("d", [1, 2, 3, 4, 8], max_tokens=20) == 1  # home 16 vs 3: 13 > 10, the lighter rank wins...
    router.release("b")
    router.release("b")  # idempotent
    assert router.load == [16, 25] and router.rank_of("b") is None
    assert router.place("e", [1, 2, 3, 4], max_tokens=0) == 1  # ...and is the prefix's home now: 25 vs 16 is within 10
    assert router.num_placed == 4
    with pytest.raises(ValueError, match="already placed"):
        router.place("a", [1], 1)


def test_lockstep_runs_one_forward_per_step() -> None:
    model = K3ForCausalLM(debug()).eval()
    lockstep = LockstepModel(model, torch.device("cpu"))
    lockstep.end_step()  # the engine ran nothing: a dummy forward keeps the collectives in step
    assert lockstep.dummy_forwards == 1
    cache = CacheTensors.allocate(model.config, 1, 2, 16)
    batch = ForwardBatch.for_step([[1, 2]], [0], [0], torch.tensor([[0, 1]]))
    with torch.inference_mode():
        lockstep(batch, cache)
        lockstep.end_step()
        assert lockstep.dummy_forwards == 1
        lockstep(batch, cache)
        lockstep(batch, cache)
    with pytest.raises(RuntimeError, match="ran 2 forwards in one step"):
        lockstep.end_step()


def test_dp_layouts_are_checked() -> None:
    with pytest.raises(ValueError, match=r"dp=2 with tp=1, ep=1: data-parallel attention spreads the experts over all dp x tp = 2 ranks"):
        ParallelConfig(dp=2)
    with pytest.raises(ValueError, match=r"dp=2 with tp=2, ep=2: data-parallel attention spreads the experts over all dp x tp = 4 ranks"):
        ParallelConfig(dp=2, tp=2, ep=2)
    assert ParallelConfig(dp=2, tp=2, ep=4).world_size == 4
    assert ParallelConfig(dp=4, ep=4).world_size == 4
    from openk3.serve.config import EngineConfig

    ParallelConfig(dp=2, ep=2).check_engine(EngineConfig(enable_prefix_caching=True))  # each rank's engine owns its cache
    with pytest.raises(ValueError, match=r"pack_cpu_weights=True \(--cpu-weight-packing\) with ep=2"):
        ParallelConfig(ep=2).check_engine(EngineConfig(pack_cpu_weights=True))  # the ranks prepare their shards unpacked
    with pytest.raises(ValueError, match=r"cuda_graphs=True with tp=2, ep=1: decode graphs capture a single-process step only"):
        ParallelConfig(tp=2).check_engine(EngineConfig(cuda_graphs=True))


@pytest.mark.distributed
def test_every_rank_stops_on_the_checkpoints_generation_config_eos(tmp_path) -> None:
    """generation_config.json's eos ends a request on whichever rank runs it, as in one process (each leader reads it)."""
    import json
    import shutil

    from openk3.serve.loading import ASSETS

    torch.set_num_threads(1)
    shutil.copytree(ASSETS / "tiny", tmp_path / "tiny")
    folder = tmp_path / "tiny"
    prompts, greedy = ["In the beginning", "And God said"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=False)
    with LLM(folder) as llm:
        free = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    eos = free[1][2]  # the second prompt (rank 1's, by the least-loaded rule) meets it as its third token
    assert eos not in free[0][:2] and eos not in free[1][:2]
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    outputs = {}
    for dp in (1, 2):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with LLM(folder, dp=dp, ep=dp) as llm:
                outputs[dp] = [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, greedy)]
    assert outputs[2] == outputs[1]
    assert outputs[2][1] == (free[1][:3], "stop")

"""LLM(..., ep=N): the caller's process drives, spawned workers hold the other experts; tokens equal a single process.

Rank 0 alone samples, so seeded and unseeded sampling (the engine's shared generator) give the single process's tokens too.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.model.moe import DenseExperts
from openk3.model.weights import load_model, save_model
from openk3.parallel.ep.backend import TokenSplit
from openk3.parallel.group import ParallelContext
from openk3.parallel.launch import run_ranks
from openk3.parallel.serving.rank_model import resident_expert_bytes
from openk3.parallel.serving.ranks import RankModelSpec, build_rank_model
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer
from tests.parallel.test_eplb_stats import skewed_load_file

PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [200, 1, 1, 7], list(range(30, 70))]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
UNSEEDED = SamplingParams(max_tokens=8, temperature=1.0, top_k=50, ignore_eos=True)


def run(llm: LLM) -> list[list[list[int]]]:
    """Greedy, seeded and unseeded tokens (in that order, all three from one engine) for PROMPTS."""
    try:
        return [[list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, p)] for p in (GREEDY, SEEDED, UNSEEDED)]
    finally:
        llm.close()


@pytest.fixture(scope="module")
def single_process() -> list[list[list[int]]]:
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the preset's "random weights" warning
        return run(LLM("debug", max_num_batched_tokens=16))


@pytest.mark.distributed
@pytest.mark.parametrize("method", ["ep", "moonep"])
def test_llm_ep2_tokens_equal_single_process(method: str, single_process: list[list[list[int]]]) -> None:
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run(LLM("debug", max_num_batched_tokens=16, ep=2, ep_method=method))  # small budget: chunked prefill beside decode
    assert got[0] == single_process[0], "greedy"
    assert got[1] == single_process[1], "seeded sampling"
    assert got[2] == single_process[2], "unseeded sampling (the engine's generator, rank 0 only)"
    assert any(a != b for a, b in zip(got[0], got[2], strict=True)), "temperature 1 should leave the greedy path somewhere"


def first_w1(model: K3ForCausalLM) -> torch.Tensor:
    experts = model.moe_layers()[0].experts
    assert isinstance(experts, DenseExperts)
    return experts.w1


@pytest.mark.distributed
def test_llm_ep_from_module_leaves_the_module_intact(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model = K3ForCausalLM(debug())
    model.init_weights(seed=3, std=0.1)
    model.eval()
    stats = tmp_path / "load.json"  # the module's own measured load, for eplb to place from
    want = run(LLM(model, max_num_batched_tokens=16, export_eplb_stats=str(stats)))[0]
    backends = [moe.backend for moe in model.moe_layers()]
    w1 = first_w1(model).detach().clone()
    got = run(LLM(model, max_num_batched_tokens=16, ep=2, ep_method="eplb", eplb_stats=str(stats)))[0]
    assert got == want
    assert [moe.backend for moe in model.moe_layers()] == backends, "close() gives the module its own expert backends back"
    assert torch.equal(first_w1(model), w1), "rank 0 copies its shard: the caller's bank is untouched"


def test_ep_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="ep=0"):
        LLM("debug", ep=0)
    with pytest.raises(ValueError, match="ep_method='nope'"):
        LLM("debug", ep=2, ep_method="nope")
    with pytest.raises(ValueError, match="neither a preset"):
        LLM("no-such-model", ep=2)


def rank_load(ctx: ParallelContext, folder: str, stats: str) -> dict[str, tuple[int, list[int]]]:
    """Per method: this rank's resident expert bytes and the first global expert id of each layer's shard (eplb placed
    from the load file `stats`)."""
    out = {}
    for method in ("moonep", "eplb"):
        spec = RankModelSpec(folder, method, torch.float32, 0, collect_stats=True, eplb_stats=stats if method == "eplb" else None)
        model, backend = build_rank_model(spec, ctx)
        assert isinstance(backend, TokenSplit)  # replicated tokens: the default
        out[method] = resident_expert_bytes(model, backend), [int(s.global_ids[0]) for s in backend.inner.shards.values()]
    return out


@pytest.fixture(scope="module")
def packed_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = K3ForCausalLM(debug())
    model.init_weights(seed=5, std=0.1)
    model.quantize_experts()  # MXFP4 experts, as K3 ships them: a shard is packed codes + scales
    folder = tmp_path_factory.mktemp("ckpt")
    save_model(model, folder)
    return folder


@pytest.mark.slow  # about 8 s, mostly two spawned interpreters importing torch; test_rank_experts.py checks the rows in process
@pytest.mark.distributed
def test_each_rank_loads_only_its_experts(packed_checkpoint: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    full = resident_expert_bytes(load_model(packed_checkpoint))
    per_rank = run_ranks(rank_load, 2, str(packed_checkpoint), str(skewed_load_file(tmp_path / "load.json")))
    num_experts = debug().moe.num_experts
    # moonep: E/2 home experts; eplb: (E + 10% redundant, rounded up to a multiple of 2) / 2 physical experts
    held = {"moonep": num_experts // 2, "eplb": (num_experts + 2) // 2}
    for rank, loaded in enumerate(per_rank):
        for method, (resident, _) in loaded.items():
            assert resident == full * held[method] // num_experts, (rank, method, resident, full)
        assert set(loaded["moonep"][1]) == {rank * num_experts // 2}, loaded["moonep"][1]


@pytest.mark.distributed
def test_llm_ep2_from_checkpoint_equals_single_process(packed_checkpoint: Path) -> None:
    torch.set_num_threads(1)
    tok = ByteTokenizer(256)  # the checkpoint ships no tokenizer
    want = run(LLM(str(packed_checkpoint), tok, max_num_batched_tokens=16))[0]
    assert run(LLM(str(packed_checkpoint), tok, max_num_batched_tokens=16, ep=2))[0] == want

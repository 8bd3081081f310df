"""Tensor parallelism: a rank's shard computes the single-device logits (cache-free and through its own cache pools),
engines with tp=2 and tp=2 + ep=2 produce the single process's tokens, a checkpoint is read block by block, and what
does not divide is refused by name."""

from __future__ import annotations

import warnings

import pytest
import torch

from openk3.config import debug, k3
from openk3.config.tensor_parallel import tensor_parallel_split_params
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.parallel.config import ParallelConfig
from openk3.parallel.group import ParallelContext
from openk3.parallel.launch import run_ranks
from openk3.parallel.tp.layout import check_tensor_parallel, rank_config
from openk3.parallel.tp.shard import parallelize_tensor
from openk3.planner.hardware import load_catalogue
from openk3.planner.inputs import Layout, Quantisation, Workload
from openk3.planner.memory import working_set
from openk3.serve.cache.spec import CacheSpec
from openk3.serve.sampling import SamplingParams
from tests.parallel.tp_cases import forward_difference

CAT = load_catalogue()
PROMPTS = [[5, 17, 99, 3, 250, 8, 41], [200, 1, 1, 7], list(range(30, 70))]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)


@pytest.mark.distributed
@pytest.mark.parametrize(("name", "split_experts"), [("debug", True), ("tied", True), ("packed", True), ("debug", False)])
def test_tp2_shard_computes_the_single_device_logits(name: str, split_experts: bool) -> None:
    """split_experts=False leaves the routed experts whole on every rank (what an EP backend then cuts by expert)."""
    for rank in run_ranks(forward_difference, 2, name, split_experts):
        assert rank["kda_heads"] == (2 if name != "packed" else 4) / 2
        assert rank["tokens"] < 1e-5 and rank["cached"] < 1e-5, rank


def generate(tp: int = 1, ep: int = 1) -> list[list[list[int]]]:
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the preset's "random weights" warning
        with LLM("debug", max_num_batched_tokens=16, tp=tp, ep=ep) as llm:  # small budget: chunked prefill beside decode
            return [[list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, p)] for p in (GREEDY, SEEDED)]


@pytest.fixture(scope="module")
def single_process() -> list[list[list[int]]]:
    return generate()


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", [{"tp": 2}, {"tp": 2, "ep": 2}], ids=["tp2", "tp2-ep2"])
def test_llm_tensor_parallel_tokens_equal_single_process(parallel: dict[str, int], single_process: list[list[list[int]]]) -> None:
    got = generate(**parallel)
    assert got[0] == single_process[0], "greedy"
    assert got[1] == single_process[1], "seeded sampling (rank 0 samples the gathered logits)"


def test_what_does_not_divide_is_named() -> None:
    with pytest.raises(ValueError, match=r"tp=3 does not divide kda\.num_heads=2, mla\.num_heads=2, vocab_size=256, intermediate_size=128"):
        check_tensor_parallel(debug(), 3, experts_split=True)
    with pytest.raises(ValueError, match=r"moe\.moe_intermediate_size / tp = 16 \(MXFP4 experts split by width need a multiple of 32\)"):
        check_tensor_parallel(debug().replace(expert_quantization="mxfp4", moe=debug().moe.__class__(8, 2, 64, latent_size=32, latent_norm=True)), 4, True)
    check_tensor_parallel(k3(), 16, experts_split=True)
    with pytest.raises(ValueError, match=r"tp=2 with ep=4: .*ep=1 or ep=2"):
        ParallelConfig(tp=2, ep=4)
    assert ParallelConfig(tp=4, ep=4).world_size == 4 and ParallelConfig(tp=2).world_size == 2


def test_the_tiers_are_accepted_and_indexed_gpus_refused_before_any_rank_starts() -> None:
    from openk3.serve.config import EngineConfig

    ParallelConfig(tp=2).check_engine(EngineConfig(enable_prefix_caching=True))  # device prefix caching: copies replayed
    ParallelConfig(tp=2).check_engine(EngineConfig(enable_prefix_caching=True, cpu_offload_bytes=1 << 20))  # mirrored per rank
    ParallelConfig(tp=2).check_engine(EngineConfig(enable_prefix_caching=True, disk_offload_dir="/tmp/x"))  # each rank's own files
    with pytest.raises(ValueError, match=r"device='cuda:0' with tp=2, ep=1: .*name no index"):
        ParallelConfig(tp=2).check_engine(EngineConfig(device="cuda:0", enable_prefix_caching=False))


SHARED = list(range(100, 180))  # an 80-token shared start: one 64-token match unit, snapshotted and reused


def generate_twice(tp: int = 1, ep: int = 1) -> tuple[list[list[int]], int]:
    """Greedy tokens of two rounds of prompts sharing SHARED (the second round starts from cached prefixes), and the
    prompt tokens served from the prefix cache."""
    torch.set_num_threads(1)
    prompts = [[*SHARED, 7, 8, 9], [*SHARED, 1], [*SHARED, 200, 3, 3, 3]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LLM("debug", max_num_batched_tokens=32, enable_prefix_caching=True, tp=tp, ep=ep) as llm:
            tokens = [list(o.outputs[0].token_ids) for _ in range(2) for o in llm.generate(prompts, GREEDY)]
            stats = llm.engine.stats().prefix_cache
            assert stats is not None
            return tokens, stats.hit_tokens


@pytest.mark.distributed
@pytest.mark.parametrize("parallel", [{"tp": 2}, {"ep": 2}], ids=["tp2", "ep2"])
def test_prefix_cache_hits_on_every_rank_give_the_single_process_tokens(parallel: dict[str, int]) -> None:
    """The prefix cache's slot and page copies on rank 0 are replayed on the workers' pools: a hit reads the same
    (per-rank) state everywhere, so the tokens equal one process's with the same hits."""
    want, want_hits = generate_twice()
    got, hits = generate_twice(**parallel)
    assert want_hits > 0 and hits == want_hits
    assert got == want


def test_sizing_context_cuts_but_never_communicates() -> None:
    model = K3ForCausalLM(debug()).eval()
    parallelize_tensor(model, ParallelContext.for_sizing(1, 2), split_experts=True)
    with pytest.raises(RuntimeError, match="rank 1 of 2 was made for sizing only"):
        model.forward_tokens(torch.zeros(1, 3, dtype=torch.int64))


def test_k3_rank_bytes_on_meta_equal_the_config_count_and_the_cache_spec() -> None:
    """TP8 on K3: the runtime's cut, counted tensor by tensor on the meta device, is the config's split count / 8 plus the
    replicated rest (what the planner charges per rank), and a rank's KDA state slot is 1/8 of the model's."""
    config = k3()
    with torch.device("meta"):
        model = K3ForCausalLM(config)

    def trunk(m: torch.nn.Module) -> int:
        return sum(t.numel() for n, t in list(m.named_parameters()) + list(m.named_buffers()) if ".experts." not in n)

    full = trunk(model)
    parallelize_tensor(model, ParallelContext.for_sizing(3, 8), split_experts=False)
    split = tensor_parallel_split_params(config)
    assert trunk(model) == full - split + split // 8
    assert trunk(model) == 12_123_316_668  # 5.75B of the 56.7B trunk (latent MoE projections, router, q_a/kv_a, norms) replicated
    whole, rank = CacheSpec.from_config(config, 64), CacheSpec.from_config(rank_config(config, 8), 64)
    assert rank.kda.bytes_per_sequence * 8 == whole.kda.bytes_per_sequence
    assert rank.mla.bytes_per_token == whole.mla.bytes_per_token  # the latent is shared by all heads: replicated
    # the planner charges a TP8 rank the same: trunk bytes in bf16, and per sequence 1/8 of the state, the whole latent
    quant = Quantisation()
    planned = working_set(config, quant, Layout(8, tp=8), Workload(context=4096, concurrency=8), CAT.system("gb300-nvl72"))
    assert quant.trunk_bits == 16 and planned.trunk == pytest.approx(2 * trunk(model))
    assert planned.kda_state == pytest.approx(8 * rank.kda.bytes_per_sequence)  # 8 sequences on every rank of the group
    assert planned.mla_cache == pytest.approx(8 * 4096 * rank.mla.bytes_per_token)


def test_k3_dp8_tp2_ep16_rank_bytes_on_meta_equal_the_planners() -> None:
    """DP8 x TP2 with EP16 on K3 (a layout the planner proposes for 16 accelerators: `openk3 serve --dp 8 --tp 2 --ep 16`):
    one rank's trunk after the TP2 cut, its routed experts as the EP runtime places them (E/16 per MoE layer, in the
    checkpoint's MXFP4 layout), and its cache per sequence, counted on the meta device, equal the planner's per-rank
    working set for Layout(16, tp=2)."""
    from openk3.model.moe import PackedExperts
    from openk3.parallel.serving.rank_model import engine_placements, rank_expert_ids

    config = k3()
    with torch.device("meta"):
        model = K3ForCausalLM(config)
    parallelize_tensor(model, ParallelContext.for_sizing(1, 2), split_experts=False)  # TP rank 1 of DP group 2 (rank 5)
    trunk = sum(t.numel() for n, t in list(model.named_parameters()) + list(model.named_buffers()) if ".experts." not in n)
    layers = [moe.layer_index for moe in model.moe_layers()]
    held = rank_expert_ids(engine_placements(layers, config.moe.num_experts, 16, "ep", None), 5)
    with torch.device("meta"):
        one = PackedExperts(1, config.moe.latent_size or config.hidden_size, config.moe.moe_intermediate_size)
    expert_bytes = sum(b.nbytes for b in one.buffers())
    routed = sum(len(ids) for ids in held.values()) * expert_bytes

    quant, layout = Quantisation(), Layout(16, tp=2)
    assert layout.dp == 8 and layout.ep_size == 16
    planned = working_set(config, quant, layout, Workload(context=4096, concurrency=64), CAT.system("gb300-nvl72"))
    assert routed == pytest.approx(planned.routed_experts)  # 56 experts x 92 MoE layers x 17,547,264 B (MXFP4)
    assert quant.trunk_bits == 16 and planned.trunk == pytest.approx(2 * trunk)
    rank = CacheSpec.from_config(rank_config(config, 2), 64)
    seqs = 64 // layout.dp  # each DP group serves its own 8 sequences
    assert planned.kda_state == pytest.approx(seqs * rank.kda.bytes_per_sequence)
    assert planned.mla_cache == pytest.approx(seqs * 4096 * rank.mla.bytes_per_token)

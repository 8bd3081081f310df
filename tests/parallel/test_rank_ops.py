"""EngineConfig.ops on several ranks: RankModelSpec carries the names, every rank selects them for its shard, and the
driver's engine selects none of its own. Expert parallelism refuses a moe name (its backends run their own grouped form)
before any rank starts; tensor parallelism without it takes one (every rank's ExpertSlices select it)."""

from __future__ import annotations

import pickle
import warnings

import pytest
import torch

from openk3.cli import build_parser
from openk3.config import debug
from openk3.launch import cli
from openk3.llm import LLM
from openk3.model import K3ForCausalLM, OpChoice
from openk3.model.kda import KimiDeltaAttention
from openk3.ops.registry import op
from openk3.parallel.config import ParallelConfig
from openk3.parallel.group import ParallelContext
from openk3.parallel.serving.ranks import RankModelSpec, build_rank_model
from openk3.parallel.tp.shard import ExpertSlices
from openk3.serve.config import EngineConfig
from openk3.serve.sampling import SamplingParams

NAIVE = "kda=naive,mla=naive,moe=naive"
PROMPTS = [[5, 17, 99, 3, 250, 8, 41], list(range(30, 70))]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_expert_parallelism_refuses_a_moe_name_before_any_rank_starts(capsys: pytest.CaptureFixture[str]) -> None:
    message = "ops moe='naive' with ep=2: expert parallelism runs the routed experts in its own grouped form"
    with pytest.raises(ValueError, match=message):
        LLM("debug", ep=2, ops=NAIVE)
    with pytest.raises(ValueError, match="with dp=2, ep=2: expert parallelism"):
        ParallelConfig(dp=2, ep=2).check_engine(EngineConfig(ops="moe=naive"))
    ParallelConfig(ep=2).check_engine(EngineConfig(ops="kda=naive,mla=naive"))  # the trunk's names apply on every rank
    ParallelConfig(ep=2).check_engine(EngineConfig(ops="moe=auto"))  # the default, which expert parallelism runs as it always does
    ParallelConfig(tp=2).check_engine(EngineConfig(ops=NAIVE))  # experts split by width run LocalExperts on each rank
    assert cli.run(build_parser().parse_args(["serve", "--model", "debug", "--ep", "2", "--ops", "moe=naive"])) == 2
    assert message in capsys.readouterr().err


def test_the_spec_carries_the_names_to_each_ranks_model() -> None:
    engine = EngineConfig(ops=NAIVE)
    spec = RankModelSpec.of("debug", ParallelConfig(), engine.torch_dtype, 0, False, ops=engine.ops)
    assert spec.ops == NAIVE and pickle.loads(pickle.dumps(spec)) == spec  # what a spawned rank receives
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the preset's random weights
        model, _ = build_rank_model(spec, ParallelContext.single())
    assert model.ops == OpChoice(kda="naive", mla="naive", moe="naive")
    assert all(a.kda_prefill is op("kda_prefill", "naive") for a in (layer.self_attn for layer in model.model.layers) if isinstance(a, KimiDeltaAttention))
    with pytest.raises(ValueError, match="kda='fla' cannot run on cpu float32"):
        build_rank_model(RankModelSpec.of(K3ForCausalLM(debug()).eval(), ParallelConfig(), torch.float32, 0, False, ops="kda=fla"), ParallelContext.single())


def greedy(llm: LLM) -> list[list[int]]:
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.close()


@pytest.mark.distributed
def test_tp2_ranks_run_the_named_ops_with_one_process_tokens() -> None:
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = greedy(LLM("debug", ops=NAIVE))
        llm = LLM("debug", ops=NAIVE, tp=2)
    assert llm.engine.config.ops == NAIVE  # a record only: the ranks selected them as they built their shards
    assert llm._ep is not None and llm._ep.driver is not None
    rank0 = llm._ep.driver.model
    assert isinstance(rank0, K3ForCausalLM) and rank0.ops == OpChoice(kda="naive", mla="naive", moe="naive")
    assert all(isinstance(m.backend, ExpertSlices) and m.backend.local.impl == "naive" for m in rank0.moe_layers())
    assert greedy(llm) == want


@pytest.mark.distributed
def test_every_rank_selects_the_names_as_it_builds_its_shard() -> None:
    """A name that cannot run here fails on every rank (a module skips the early check on the configured device), and the
    data-parallel start-up reports each rank's failure: rank 1 received the names through the spec."""
    torch.set_num_threads(1)
    module = K3ForCausalLM(debug()).eval()
    with pytest.raises(
        RuntimeError,
        match=r"start-up failed on 2 rank\(s\): rank 0: ValueError: EngineConfig.ops: kda='fla' cannot run .*; rank 1: ValueError: EngineConfig.ops: kda='fla'",
    ):
        LLM(module, ops="kda=fla", dp=2, ep=2)

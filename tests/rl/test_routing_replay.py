"""Routing replay: the experts the engine records for every token of a completion (SamplingParams.return_routing) are the
ones the model's own cache-free forward chooses, and a trainer's forward that replays them gives the engine's logprobs
(fp32, 1e-4) even after the trainer's router has moved so that it would choose other experts."""

import copy
from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.ops.registry import OpTarget
from openk3.rl.routing_replay import replay_routing, trace_rows
from openk3.serve.routing import RoutingRecorder
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

BASE: dict[str, Any] = dict(page_size=4, num_pages=160, max_num_seqs=4, max_model_len=256)


@pytest.fixture(scope="module")
def model() -> K3ForCausalLM:
    m = K3ForCausalLM(debug())
    m.init_weights(seed=5)
    return m.eval()


def natural_routing(model: K3ForCausalLM, ids: list[int]) -> torch.Tensor:
    """[T, L, k] experts the model chooses itself in one cache-free forward."""
    recorder = RoutingRecorder(model)
    with recorder.step(), torch.inference_mode():
        model.forward_tokens(torch.tensor([ids]))
    return recorder.rows()


def sampled_logprobs(model: K3ForCausalLM, ids: list[int], prompt_len: int) -> torch.Tensor:
    logprobs = model.forward_tokens(torch.tensor([ids[:-1]])).float().log_softmax(-1)[0]
    return logprobs[prompt_len - 1 :].gather(1, torch.tensor(ids[prompt_len:])[:, None])[:, 0]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_recorded_routing_replays_to_the_engines_logprobs(model, prefix_caching) -> None:
    trainer = copy.deepcopy(model)  # the engine prepares its module for serving; the trainer keeps a plain copy
    prompt = list(range(40, 71))
    llm = LLM(model, ByteTokenizer(256), enable_prefix_caching=prefix_caching, **BASE)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=7, logprobs=0, return_routing=True, ignore_eos=True)
    if prefix_caching:
        llm.generate([prompt], SamplingParams(max_tokens=1))  # caches the prompt: a request with routing must not use it
    (out,) = llm.generate([prompt], [params])
    sample = out.outputs[0]
    ids = prompt + list(sample.token_ids)
    trace = sample.routing
    assert trace is not None and trace.experts_TLk.shape[0] == len(ids) - 1
    assert trace.experts_TLk.shape[1:] == (len(trainer.moe_layers()), trainer.config.moe.num_experts_per_token)
    # the same expert choice as the model's own forward over the same tokens (as sets: implementations may order top-k)
    natural = natural_routing(trainer, ids[:-1])
    assert torch.equal(natural.sort(-1).values, trace.experts_TLk.sort(-1).values)
    engine_lp = torch.tensor([lp.logprob for lp in sample.logprobs or ()])
    with replay_routing(trainer, trace_rows([trace])), torch.inference_mode():
        replayed = sampled_logprobs(trainer, ids, len(prompt))
    torch.testing.assert_close(replayed, engine_lp, atol=1e-4, rtol=0)
    llm.close()


def test_replay_forces_the_recorded_experts_on_a_moved_router(model) -> None:
    trainer = copy.deepcopy(model)
    trainer.select_ops(target=OpTarget(training=True))  # differentiable implementations (a trainer's own choice)
    prompt = list(range(80, 110))
    llm = LLM(model, ByteTokenizer(256), **BASE)
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=0, return_routing=True, ignore_eos=True))
    llm.close()
    trace = out.outputs[0].routing
    assert trace is not None
    ids = prompt + list(out.outputs[0].token_ids)
    with torch.no_grad():
        for moe in trainer.moe_layers():  # a training step moved the router: its own choice now differs
            moe.gate.weight.add_(torch.randn_like(moe.gate.weight, generator=torch.Generator().manual_seed(moe.layer_index)))
    assert not torch.equal(natural_routing(trainer, ids[:-1]).sort(-1).values, trace.experts_TLk.sort(-1).values)
    recorder = RoutingRecorder(trainer)
    with replay_routing(trainer, trace_rows([trace])), recorder.step():
        logits = trainer.forward_tokens(torch.tensor([ids[:-1]]))
    assert torch.equal(recorder.rows().sort(-1).values, trace.experts_TLk.sort(-1).values)
    logits.float().log_softmax(-1).sum().backward()  # the replayed weights still carry gradients to the router
    assert all(moe.gate.weight.grad is not None and bool(moe.gate.weight.grad.abs().sum() > 0) for moe in trainer.moe_layers())


def test_each_sample_of_a_group_gets_its_own_routing(model) -> None:
    trainer = copy.deepcopy(model)
    prompt = list(range(120, 140))
    llm = LLM(model, ByteTokenizer(256), **BASE)
    (out,) = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, return_routing=True, ignore_eos=True))
    llm.close()
    assert len({s.token_ids for s in out.outputs}) > 1  # the samples differ, so their routing past the prompt may too
    for sample in out.outputs:
        assert sample.routing is not None
        ids = prompt + list(sample.token_ids)
        assert torch.equal(natural_routing(trainer, ids[:-1]).sort(-1).values, sample.routing.experts_TLk.sort(-1).values)

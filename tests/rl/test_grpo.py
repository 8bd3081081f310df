"""GRPO (rl/grpo.py): group-relative advantages, and one step on a group the engine sampled (logprobs and routing from the
engine, replayed in the trainer's forward) raises the likelihood of the rewarded sample and lowers the others', with the
trainer's logprobs equal to the engine's before the step (the trainer holds the weights the engine sampled with)."""

import copy

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.ops.registry import OpTarget
from openk3.rl.grpo import GRPOConfig, group_advantages, grpo_step
from openk3.rl.routing_replay import replay_routing, trace_rows
from openk3.rl.trajectory import Trajectory, Turn
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer


def test_group_advantages() -> None:
    assert group_advantages([1.0, 0.0, 0.0, 1.0], eps=1e-9) == pytest.approx([1.0, -1.0, -1.0, 1.0])
    assert group_advantages([0.5, 0.5, 0.5]) == [0.0, 0.0, 0.0]  # no signal, no gradient
    with pytest.raises(ValueError, match="empty"):
        group_advantages([])


def sequence_logprob(model: K3ForCausalLM, t: Trajectory) -> float:
    ids = torch.tensor([t.token_ids])
    assert t.routing is not None
    with replay_routing(model, trace_rows([t.routing])), torch.no_grad():
        logprobs = model.forward_tokens(ids[:, :-1]).float().log_softmax(-1)[0]
    return sum(float(logprobs[i - 1, t.token_ids[i]]) for i, m in enumerate(t.loss_mask) if m)


def test_one_step_raises_the_rewarded_sample() -> None:
    policy = K3ForCausalLM(debug())
    policy.init_weights(seed=3)
    policy.eval()
    trainer = copy.deepcopy(policy)
    trainer.select_ops(target=OpTarget(training=True))
    llm = LLM(policy, ByteTokenizer(256), page_size=4, num_pages=100, max_num_seqs=4, max_model_len=64)
    prompt = list(b"2+2=")
    params = SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=3, logprobs=0, return_routing=True, ignore_eos=True)
    (out,) = llm.generate([prompt], params)
    llm.close()
    group = []
    for s in out.outputs:
        logprobs = (None,) * len(prompt) + tuple(lp.logprob for lp in s.logprobs or ())
        mask = tuple(lp is not None for lp in logprobs)
        reward = 1.0 if s.index == 0 else 0.0
        group.append(Trajectory("2+2", s.index, tuple(prompt) + s.token_ids, mask, logprobs, (Turn("", None, None),), reward, 0, s.routing))
    assert len({t.token_ids for t in group}) == 4  # four different samples, or the test shows nothing
    before = [sequence_logprob(trainer, t) for t in group]
    optimizer = torch.optim.SGD(trainer.parameters(), lr=0.5)
    stats = grpo_step(trainer, optimizer, group, group_advantages([t.reward for t in group]), GRPOConfig(max_grad_norm=10.0))
    assert stats.max_logprob_gap < 1e-4 and stats.tokens == 12 and stats.clipped == 0.0  # on policy: every ratio is 1
    after = [sequence_logprob(trainer, t) for t in group]
    assert after[0] > before[0]
    assert all(a < b for a, b in zip(after[1:], before[1:], strict=True))

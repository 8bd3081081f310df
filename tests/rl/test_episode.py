"""Agent episodes end to end in real sandboxes: a scripted policy (known replies) shows the token bookkeeping exactly, the
group's forks isolated from each other, and bad tool calls recorded rather than raised; the engine's policy shows that the
sampled tokens' logprobs and routing line up with a trainer's forward over the trajectory."""

import copy
from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.rl.episode import Task, run_group
from openk3.rl.policy import LLMPolicy, ScriptedPolicy
from openk3.rl.routing_replay import replay_routing, trace_rows
from openk3.rl.tools import Sandboxes, observation_text
from openk3.rl.trajectory import ToolStatus
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer

pytestmark = pytest.mark.sandbox

SCRIPT = {
    0: ["<bash>echo 42 > /root/work/answer</bash>", "done"],
    1: ["<bash>cat /root/work/answer</bash>", "<bash>echo 42 > /root/work/answer", "gave up"],  # sees no file of branch 0's
    2: ["<bash>sleep 5</bash>", "done"],
}


def answer_is_42(sandboxes: Sandboxes, sandbox_id: str) -> float:
    r = sandboxes.exec(sandbox_id, "cat /root/work/answer", timeout_s=10)
    return 1.0 if r.exit_code == 0 and r.stdout.strip() == b"42" else 0.0


TASK = Task("answer-42", "Write 42 to /root/work/answer.\n", answer_is_42, setup="mkdir -p /root/work")


def test_scripted_group_records_exact_tokens_isolated_forks_and_bad_calls(sandboxes) -> None:
    tok = ByteTokenizer(256)
    policy = ScriptedPolicy(tok, lambda branch, turn: SCRIPT[branch][turn])
    before = {s.sandbox_id for s in sandboxes.list_sandboxes()}
    trajectories = run_group(TASK, policy, sandboxes, n=3, max_turns=3, tool_timeout_s=1.0)
    assert {s.sandbox_id for s in sandboxes.list_sandboxes()} == before  # every fork and the base removed
    assert [t.reward for t in trajectories] == [1.0, 0.0, 0.0]
    first, second, third = trajectories
    assert [t.status for t in first.turns] == [ToolStatus.OK, None]
    assert first.turns[0].exit_code == 0
    expected = tok.encode(TASK.prompt, add_special_tokens=True)
    mask = [False] * len(expected)
    for turn in first.turns:
        reply = tok.encode(turn.reply)
        expected += reply
        mask += [True] * len(reply)
        if turn.status is not None:
            obs = tok.encode(turn.observation)
            expected += obs
            mask += [False] * len(obs)
    assert list(first.token_ids) == expected and list(first.loss_mask) == mask
    assert all((lp == 0.0) == m for lp, m in zip(first.logprobs, first.loss_mask, strict=True))
    assert first.turns[0].observation == observation_text("\n[exit code 0]")
    assert second.turns[0].status == ToolStatus.OK and second.turns[0].exit_code != 0  # the fork of branch 0 is not shared
    assert second.turns[1].status == ToolStatus.MALFORMED and second.turns[1].command is None
    assert second.turns[2].status is None and second.turns[2].reply == "gave up"
    assert third.turns[0].status == ToolStatus.TIMED_OUT and third.turns[1].status is None


def test_engine_policy_logprobs_and_routing_line_up_with_a_trainer_forward(sandboxes) -> None:
    model = K3ForCausalLM(debug())
    model.init_weights(seed=5)
    model.eval()
    trainer = copy.deepcopy(model)
    base: dict[str, Any] = dict(page_size=4, num_pages=200, max_num_seqs=4, max_model_len=256)
    llm = LLM(model, ByteTokenizer(256), **base)
    # replies end at "\n\n" or 12 tokens; any of them that happens to write a tool call runs it
    policy = LLMPolicy(llm, SamplingParams(temperature=1.0, max_tokens=12, seed=1), return_routing=True)
    trajectories = run_group(TASK, policy, sandboxes, n=2, max_turns=2)
    llm.close()
    for t in trajectories:
        assert t.weight_version == 0 and t.routing is not None
        ids = list(t.token_ids)
        last_sampled = max(i for i, m in enumerate(t.loss_mask) if m)
        assert t.routing.experts_TLk.shape[0] == last_sampled  # every position but the last reply's last token
        with replay_routing(trainer, trace_rows([t.routing])), torch.inference_mode():
            logits = trainer.forward_tokens(torch.tensor([ids[:last_sampled]])).float().log_softmax(-1)[0]
        sampled = [i for i, m in enumerate(t.loss_mask) if m]
        want = torch.tensor([t.logprobs[i] for i in sampled])
        got = torch.stack([logits[i - 1, ids[i]] for i in sampled])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

"""Branching mid-episode (rl/branching.py): with a scripted policy and in-memory sandboxes, the trunk's files and tokens reach
every branch, the branches' sandboxes are isolated and everything made is removed; against a real engine with prefix caching,
each branch's first request takes the trunk's context from the cache, and every branch's replies equal those of an engine
without a prefix cache given the same contexts, with logprobs equal to a cache-free forward over the trajectory."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.rl.branching import run_branched
from openk3.rl.episode import Task
from openk3.rl.policy import LLMPolicy, ScriptedPolicy
from openk3.rl.tools import Sandboxes
from openk3.rl.trajectory import ToolStatus
from openk3.serve.sampling import SamplingParams
from openk3.serve.structured.compiler import GrammarCompiler
from openk3.serve.structured.spec import StructuredOutputs
from openk3.serve.tokenizer import ByteTokenizer
from tests.api.conftest import torch_one_thread
from tests.rl.fake_sandboxes import FakeSandboxes

__all__ = ["torch_one_thread"]  # the engine's small matmuls run fastest single-threaded on shared cores


def one_trunk_file_and_one_own(sandboxes: Sandboxes, sandbox_id: str) -> float:
    found = [sandboxes.exec(sandbox_id, f"read {key}").exit_code == 0 for key in ("base", "b0", "b1", "b2")]
    return 1.0 if found[0] and sum(found[1:]) == 1 else 0.0


TASK = Task("fork", "Write files.\n", one_trunk_file_and_one_own)


def script(branch: int, turn: int) -> str:
    return ["<bash>write base 1</bash>", f"<bash>write b{branch} x</bash>", "done"][turn]


def test_branches_share_the_trunk_and_nothing_else() -> None:
    sandboxes = FakeSandboxes()
    tok = ByteTokenizer(256)
    group = run_branched(TASK, ScriptedPolicy(tok, script), sandboxes, branch_at=1, n=3, max_turns=3)
    assert sandboxes.files == {} and sandboxes.snapshots == {}  # base, trunk, forks and both snapshots removed
    assert group.trunk_turns == 1 and group.fork_s is not None and len(group.trajectories) == 3
    trunk = tok.encode(TASK.prompt, add_special_tokens=True) + tok.encode(script(0, 0)) + tok.encode("\n<output>\n\n[exit code 0]\n</output>\n")
    assert group.shared_tokens == len(trunk)
    for i, t in enumerate(group.trajectories):
        assert t.index == i and t.shared_prefix == len(trunk) and list(t.token_ids[: len(trunk)]) == trunk
        assert [turn.command for turn in t.turns] == ["write base 1", f"write b{i} x", None]
        assert [turn.status for turn in t.turns] == [ToolStatus.OK, ToolStatus.OK, None]
        assert t.reward == 1.0  # its own file and the trunk's, no sibling's
    # the trunk ran its command once, in one sandbox; each branch ran its own in its own
    writes = [(sid, cmd) for sid, cmd in sandboxes.log if cmd.startswith("write")]
    assert [cmd for _, cmd in writes] == ["write base 1", "write b0 x", "write b1 x", "write b2 x"]
    assert len({sid for sid, _ in writes}) == 4


def test_a_trunk_that_ends_before_the_branch_point_is_returned_alone() -> None:
    sandboxes = FakeSandboxes()
    policy = ScriptedPolicy(ByteTokenizer(256), lambda branch, turn: "no tool")
    group = run_branched(TASK, policy, sandboxes, branch_at=2, n=3, max_turns=3)
    assert group.fork_s is None and group.trunk_turns == 1 and len(group.trajectories) == 1
    assert sandboxes.files == {} and sandboxes.snapshots == {}
    with pytest.raises(ValueError, match="branch_at"):
        run_branched(TASK, policy, sandboxes, branch_at=3, n=2, max_turns=3)


BASE: dict[str, Any] = dict(page_size=4, num_pages=300, max_num_seqs=4, max_model_len=512)


@pytest.mark.parametrize("return_routing", [False, True])
def test_branches_hit_the_trunk_in_the_prefix_cache(return_routing, torch_one_thread) -> None:
    model = K3ForCausalLM(debug())
    model.init_weights(seed=5)
    model.eval()
    trainer, plain_model = copy.deepcopy(model), copy.deepcopy(model)
    tok = ByteTokenizer(256)
    # the grammar makes the random model call the tool every turn, so the episode reaches the branch point
    grammar = GrammarCompiler(tok, 256).compile(StructuredOutputs(regex=r"<bash>write b[0-2] [0-9]</bash>"))
    params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=grammar, stop=("</bash>",), include_stop_str_in_output=True)
    llm = LLM(model, tok, enable_prefix_caching=True, prefix_match_unit=8, **BASE)
    group = run_branched(TASK, LLMPolicy(llm, params, return_routing), FakeSandboxes(), branch_at=2, n=2, max_turns=3)
    llm.close()
    assert group.fork_s is not None and len(group.trajectories) == 2
    if return_routing:  # a cached prefix has no routing to record: the branches recompute the trunk (rl/branching.py)
        assert group.first_cached == [0, 0]
    else:
        assert all(0 < c <= group.shared_tokens for c in group.first_cached)
    plain = LLM(plain_model, tok, **BASE)  # no prefix cache: every context computed from its first token
    for t in group.trajectories:
        starts = [i for i in range(len(t.token_ids)) if t.loss_mask[i] and not t.loss_mask[i - 1]]  # each reply's first token
        assert len(starts) == 3
        for start in starts[1:]:  # the replies sampled after the fork
            end = next((i for i in range(start, len(t.token_ids)) if not t.loss_mask[i]), len(t.token_ids))
            (want,) = plain.generate([list(t.token_ids[:start])], params)
            assert list(t.token_ids[start:end]) == list(want.outputs[0].token_ids)
        ids = list(t.token_ids)
        with torch.inference_mode():
            logits = trainer.forward_tokens(torch.tensor([ids])).float().log_softmax(-1)[0]
        sampled = [i for i, m in enumerate(t.loss_mask) if m]
        want_lp = torch.stack([logits[i - 1, ids[i]] for i in sampled])
        torch.testing.assert_close(torch.tensor([t.logprobs[i] for i in sampled]), want_lp, atol=1e-4, rtol=0)
        assert (t.routing is not None) == return_routing
    plain.close()

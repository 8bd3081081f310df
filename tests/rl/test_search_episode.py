"""Episodes with the document tools (rl/documents.py, rl/tools.py) over the example task shipped in
examples/tasks/harbour: a scripted policy searches, opens the right page, writes the answer and gets reward 1; hostile
calls are recorded as INVALID turns, never raised; the tool results are in the trajectory with the loss mask off; a
branched episode's branches read the same store; with real sandboxes the task file's own verify command gives the
reward."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from openk3.rl.async_episode import run_group_async
from openk3.rl.branching import run_branched
from openk3.rl.episode import Task, run_group
from openk3.rl.policy import Context, Reply, ScriptedPolicy
from openk3.rl.task_file import load_task, trajectory_record
from openk3.rl.tools import Sandboxes
from openk3.rl.trajectory import ToolStatus, Trajectory
from openk3.serve.tokenizer import ByteTokenizer, Tokenizer
from tests.rl.fake_sandboxes import FakeSandboxes

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "harbour" / "task.json"

SCRIPT = {
    0: [
        "<search>Harrowmere ferry</search>",
        "<open>ferry</open>",
        '<search k="2">who built the lighthouse</search>',
        '<open page="2">tollan-lighthouse</open>',
        "<bash>write answer MarenAshby</bash>",
        "Maren Ashby built it.",
    ],
    1: [
        "<open>../../etc/passwd</open>",
        "<open>/etc/passwd</open>",
        '<open page="99999999">ferry</open>',
        "<search>ferry",
        "I could not find it.",
    ],
}


def fake_answer_is_maren_ashby(sandboxes: Sandboxes, sandbox_id: str) -> float:
    r = sandboxes.exec(sandbox_id, "read answer")
    return 1.0 if r.exit_code == 0 and r.stdout == b"MarenAshby" else 0.0


def example_task_with_fake_verifier() -> Task:
    task = load_task(EXAMPLE)
    return Task(task.task_id, task.prompt, fake_answer_is_maren_ashby, None, task.documents)


def expected_tokens(t: Trajectory, prompt: str, tok: ByteTokenizer) -> tuple[list[int], list[bool]]:
    ids = tok.encode(prompt, add_special_tokens=True)
    mask = [False] * len(ids)
    for turn in t.turns:
        reply = tok.encode(turn.reply)
        ids += reply
        mask += [True] * len(reply)
        if turn.status is not None:
            obs = tok.encode(turn.observation)
            ids += obs
            mask += [False] * len(obs)
    return ids, mask


def test_scripted_search_open_answer_gets_reward_1_and_hostile_calls_are_recorded() -> None:
    tok = ByteTokenizer(256)
    task = example_task_with_fake_verifier()
    sandboxes = FakeSandboxes()
    policy = ScriptedPolicy(tok, lambda branch, turn: SCRIPT[branch][turn])
    good, bad = run_group(task, policy, sandboxes, n=2, max_turns=8, tool_timeout_s=5.0)
    assert sandboxes.files == {} and sandboxes.snapshots == {}  # every sandbox and snapshot removed
    assert (good.reward, bad.reward) == (1.0, 0.0)

    assert [u.tool for u in good.turns] == ["search", "open", "search", "open", "bash", None]
    assert [u.status for u in good.turns] == [ToolStatus.OK] * 5 + [None]
    assert good.turns[0].observation.startswith("\n<output>\n1. [ferry] The Harrowmere ferry")
    assert "links: harrowmere (Harrowmere); tollan-isle (Tollan Isle)" in good.turns[1].observation
    assert good.turns[2].observation.count("\n   ") == 2  # k="2": two results, each with its snippet line
    assert "(page 2 of 2)" in good.turns[3].observation and "Maren Ashby" in good.turns[3].observation
    assert [u.command for u in good.turns[:4]] == ["Harrowmere ferry", "ferry", "who built the lighthouse", "tollan-lighthouse"]

    # the tool results are in the token stream, the loss mask is off on them and on the prompt, on exactly where replies are
    for t in (good, bad):
        ids, mask = expected_tokens(t, task.prompt, tok)
        assert list(t.token_ids) == ids and list(t.loss_mask) == mask
        assert all((lp is not None) == m for lp, m in zip(t.logprobs, t.loss_mask, strict=True))

    assert [u.status for u in bad.turns] == [ToolStatus.INVALID] * 3 + [ToolStatus.MALFORMED, None]
    assert [u.tool for u in bad.turns[:4]] == ["open", "open", "open", "search"]
    assert "error: no document '../../etc/passwd'" in bad.turns[0].observation
    assert "error: no document '/etc/passwd'" in bad.turns[1].observation
    assert "page 99999999 does not exist" in bad.turns[2].observation
    assert "search call must be" in bad.turns[3].observation
    assert all(cmd == "read answer" or cmd.startswith("write ") for _, cmd in sandboxes.log)  # no doc tool reached a sandbox

    record = trajectory_record(good, 0, with_routing=False)
    assert [u["tool"] for u in record["turns"]] == ["search", "open", "search", "open", "bash", None]
    assert [u["status"] for u in trajectory_record(bad, 0, False)["turns"]][:4] == ["invalid", "invalid", "invalid", "malformed"]


def test_branches_of_a_searched_trunk_read_the_same_store() -> None:
    tok = ByteTokenizer(256)
    task = example_task_with_fake_verifier()
    pages = ["1", "2"]

    def script(branch: int, turn: int) -> str:
        if turn == 0:
            return "<search>lighthouse</search>"
        if turn == 1:
            return f'<open page="{pages[branch]}">tollan-lighthouse</open>'
        return "<bash>write answer MarenAshby</bash>" if turn == 2 and branch == 1 else "done"

    group = run_branched(task, ScriptedPolicy(tok, script), FakeSandboxes(), branch_at=1, n=2, max_turns=4)
    first, second = group.trajectories
    assert first.token_ids[: group.shared_tokens] == second.token_ids[: group.shared_tokens]
    assert "(page 1 of 2)" in first.turns[1].observation and "(page 2 of 2)" in second.turns[1].observation
    assert (first.reward, second.reward) == (0.0, 1.0)


class ScriptedAsyncPolicy:
    def __init__(self) -> None:
        self.tokenizer: Tokenizer = ByteTokenizer(256)

    async def reply(self, context: Context, turn: int) -> Reply:
        ids = tuple(self.tokenizer.encode(SCRIPT[context.branch][turn]))
        return Reply(ids, (0.0,) * len(ids), None, 0)


def test_the_async_runner_records_the_same_document_turns() -> None:
    task = example_task_with_fake_verifier()
    sync = run_group(task, ScriptedPolicy(ByteTokenizer(256), lambda b, t: SCRIPT[b][t]), FakeSandboxes(), n=2, max_turns=8)
    rollouts = asyncio.run(run_group_async(task, ScriptedAsyncPolicy(), FakeSandboxes(), n=2, max_turns=8))
    assert rollouts.dropped == []
    for a, b in zip(rollouts.trajectories, sync, strict=True):
        assert (a.token_ids, a.loss_mask, a.turns, a.reward) == (b.token_ids, b.loss_mask, b.turns, b.reward)


@pytest.mark.sandbox
def test_the_example_task_file_rewards_the_right_answer_in_a_real_sandbox(sandboxes) -> None:
    tok = ByteTokenizer(256)
    task = load_task(EXAMPLE)
    answers = {0: "Maren Ashby", 1: "Osric Vane"}

    def script(branch: int, turn: int) -> str:
        return [
            "<search>who built the Tollan lighthouse</search>",
            '<open page="2">tollan-lighthouse</open>',
            f"<bash>echo '{answers[branch]}' > /root/work/answer</bash>",
            f"{answers[branch]}.",
        ][turn]

    right, wrong = run_group(task, ScriptedPolicy(tok, script), sandboxes, n=2, max_turns=5, tool_timeout_s=10.0)
    assert [u.tool for u in right.turns] == ["search", "open", "bash", None]
    assert right.turns[2].status == ToolStatus.OK and right.turns[2].exit_code == 0
    assert (right.reward, wrong.reward) == (1.0, 0.0)

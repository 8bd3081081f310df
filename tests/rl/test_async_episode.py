"""Episodes run concurrently (rl/async_episode.py): with a scripted policy and in-memory sandboxes, a branch whose tool
blocks does not hold the others back (the blocked tool is released only by another branch of the same group finishing,
which would deadlock turns taken in lockstep), bad calls are recorded, and an episode whose replies span two weight
versions is dropped and counted; against a real AsyncEngine every branch of several groups is in the engine at once and
the sampled logprobs equal a trainer's cache-free forward over the trajectory."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import torch

from openk3.config import debug
from openk3.llm import LLM
from openk3.model import K3ForCausalLM
from openk3.rl.async_episode import run_group_async, run_groups_async
from openk3.rl.async_policy import AsyncEnginePolicy
from openk3.rl.episode import Task
from openk3.rl.policy import Context, Reply
from openk3.rl.tools import Sandboxes
from openk3.rl.trajectory import ToolStatus
from openk3.serve.async_engine import AsyncEngine
from openk3.serve.engine_api import ServedEngine
from openk3.serve.output import FinishedRequest
from openk3.serve.sampling import SamplingParams
from openk3.serve.tokenizer import ByteTokenizer, Tokenizer
from tests.api.conftest import GatedStep
from tests.rl.fake_sandboxes import FakeSandboxes

SCRIPT = {
    0: ["<bash>wait go</bash>", "done waiting"],  # blocks until branch 1 has finished
    1: ["<bash>write answer 42</bash>", "<bash>read answer</bash>", "answer written"],
    2: ["<bash>refuse</bash>", "<bash>write answer 7", "gave up"],
}


def answer_is_42(sandboxes: Sandboxes, sandbox_id: str) -> float:
    r = sandboxes.exec(sandbox_id, "read answer")
    return 1.0 if r.stdout == b"42" else 0.0


TASK = Task("answer-42", "Write 42 to answer.\n", answer_is_42)


class ScriptedAsyncPolicy:
    def __init__(self, sandboxes: FakeSandboxes, versions: dict[tuple[int, int], int]) -> None:
        self.tokenizer: Tokenizer = ByteTokenizer(256)
        self.sandboxes = sandboxes
        self.versions = versions  # (branch, turn) -> weight version, 0 elsewhere

    async def reply(self, context: Context, turn: int) -> Reply:
        text = SCRIPT[context.branch][turn]
        if text == "answer written":
            self.sandboxes.event("go").set()
        ids = tuple(self.tokenizer.encode(text))
        return Reply(ids, (0.0,) * len(ids), None, self.versions.get((context.branch, turn), 0))


def test_a_blocked_tool_holds_no_other_branch_back() -> None:
    sandboxes = FakeSandboxes()
    policy = ScriptedAsyncPolicy(sandboxes, {(2, 1): 1})
    rollouts = asyncio.run(run_group_async(TASK, policy, sandboxes, n=3, max_turns=3, tool_timeout_s=5))
    assert sandboxes.files == {} and sandboxes.snapshots == {}  # every fork, the base and the snapshot removed
    first, second = rollouts.trajectories
    assert rollouts.dropped == ["answer-42/2: replies sampled with weight versions [0, 1, 0]"]
    assert [t.status for t in first.turns] == [ToolStatus.OK, None] and first.turns[0].observation.startswith("\n<output>\nreleased")
    assert [t.status for t in second.turns] == [ToolStatus.OK, ToolStatus.OK, None]
    assert (first.reward, second.reward) == (0.0, 1.0)  # the forks do not share files
    assert first.weight_version == second.weight_version == 0


def test_bad_calls_are_recorded() -> None:
    sandboxes = FakeSandboxes()
    sandboxes.event("go").set()
    rollouts = asyncio.run(run_group_async(TASK, ScriptedAsyncPolicy(sandboxes, {}), sandboxes, n=3, max_turns=3))
    third = rollouts.trajectories[2]
    assert [t.status for t in third.turns] == [ToolStatus.REFUSED, ToolStatus.MALFORMED, None]
    assert third.turns[0].observation == "\n<output>\nerror: SandboxError: refused\n</output>\n"


class MostRunning:
    """An EngineObserver that keeps the most requests the engine held running after any step."""

    def __init__(self) -> None:
        self.most = 0

    def observe_engine(self, engine: ServedEngine) -> None:
        self.most = max(self.most, engine.stats().num_requests_running)

    def observe_tokens(self, inter_token_latencies: list[float]) -> None: ...

    def observe_first_tokens(self, first_token_latencies: list[float]) -> None: ...

    def observe_prompt(self, num_prompt_tokens: int, num_cached_tokens: int) -> None: ...

    def observe_finished(self, done: FinishedRequest) -> None: ...


def test_every_branch_of_several_groups_is_in_the_engine_at_once() -> None:
    model = K3ForCausalLM(debug())
    model.init_weights(seed=5)
    model.eval()
    trainer = copy.deepcopy(model)
    base: dict[str, Any] = dict(page_size=4, num_pages=200, max_num_seqs=8, max_model_len=256)
    llm = LLM(model, ByteTokenizer(256), **base)
    gate = GatedStep(llm.engine)
    observer = MostRunning()
    sandboxes = FakeSandboxes()
    tasks = [Task(f"t{i}", f"Task {i}: write 42 to answer.\n", answer_is_42) for i in range(3)]

    async def main() -> Any:
        frontend = AsyncEngine(llm.engine, observer=observer)
        frontend.start()
        policy = AsyncEnginePolicy(frontend, SamplingParams(temperature=1.0, max_tokens=6, seed=1, ignore_eos=True))
        running = asyncio.ensure_future(run_groups_async(tasks, policy, sandboxes, n=2, max_turns=2))
        while frontend.num_active < 6 and not running.done():  # every branch's first reply asked for, the first step held
            await asyncio.sleep(0)
        gate.release.set()
        out = await running
        await frontend.shutdown()
        return out

    rollouts = asyncio.run(main())
    llm.close()
    assert observer.most == 6 and not rollouts.dropped and len(rollouts.trajectories) == 6
    for t in rollouts.trajectories:
        assert t.weight_version == 0
        ids = list(t.token_ids)
        with torch.inference_mode():
            logits = trainer.forward_tokens(torch.tensor([ids])).float().log_softmax(-1)[0]
        sampled = [i for i, m in enumerate(t.loss_mask) if m]
        want = torch.tensor([t.logprobs[i] for i in sampled])
        got = torch.stack([logits[i - 1, ids[i]] for i in sampled])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)

"""`openk3 rollout` (rl/cli.py) with in-memory sandboxes: against an engine built in process and against a live server
(`--url`), the JSONL trajectories hold the exact ids, a loss mask that agrees with the logprobs, the routed experts when
asked, the reward the task's verify command gives and the weight version; the served engine's greedy trajectories equal
the in-process ones of the same model. A task file with an unknown key is refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from openk3.cli import build_parser, main
from openk3.rl.cli import rollout
from tests.api.conftest import LiveServer, start_server, stop_server, torch_one_thread
from tests.rl.fake_sandboxes import FakeSandboxes

TASK = {"task_id": "answer", "prompt": "Write 42 to answer.\n", "setup": "write answer 42", "verify": "read answer"}


__all__ = ["torch_one_thread"]  # the engine's small matmuls run fastest single-threaded on shared cores


@pytest.fixture(scope="module")
def live(torch_one_thread) -> Iterator[LiveServer]:
    server = start_server()
    yield server
    stop_server(server)


def task_file(tmp_path: Path, spec: dict) -> Path:
    path = tmp_path / "task.json"
    path.write_text(json.dumps(spec))
    return path


def run(tmp_path: Path, name: str, *flags: str) -> tuple[dict, list[dict]]:
    out = tmp_path / f"{name}.jsonl"
    argv = ["rollout", "--task", str(task_file(tmp_path, TASK)), "--out", str(out), "--episodes", "3", "--group", "2"]
    argv += ["--max-tokens", "8", "--temperature", "0", "--max-turns", "2", *flags]
    summary = rollout(build_parser().parse_args(argv), sandboxes=FakeSandboxes())
    return summary, [json.loads(line) for line in out.read_text().splitlines()]


def check(records: list[dict], routing: bool) -> None:
    assert [(r["group"], r["index"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # 3 episodes: two whole groups
    prompt = list(TASK["prompt"].encode())  # the debug preset's byte tokenizer has no bos
    for r in records:
        ids, mask, logprobs = r["token_ids"], r["loss_mask"], r["logprobs"]
        assert ids[: len(prompt)] == prompt and len(ids) == len(prompt) + 8  # a reply of max_tokens, no tool call in it
        assert mask == [False] * len(prompt) + [True] * 8
        assert [lp is not None for lp in logprobs] == mask
        assert r["reward"] == 1.0 and r["weight_version"] == 0 and r["shared_prefix"] == 0  # the setup wrote the answer
        assert [t["command"] for t in r["turns"]] == [None]
        if routing:
            experts = r["routed_experts"]["experts"]
            assert len(experts) == len(ids) - 1 and len(experts[0]) == len(r["routed_experts"]["layers"])
        else:
            assert "routed_experts" not in r


def test_in_process_and_served_give_the_same_trajectories(tmp_path, live) -> None:
    local_summary, local = run(tmp_path, "local", "--routing", "--max-model-len", "256")
    assert local_summary["trajectories"] == 4 and local_summary["dropped"] == [] and local_summary["mean_reward"] == 1.0
    check(local, routing=True)
    served_summary, served = run(tmp_path, "served", "--routing", "--url", live.base_url)
    check(served, routing=True)
    for a, b in zip(local, served, strict=True):
        assert a["token_ids"] == b["token_ids"] and a["routed_experts"] == b["routed_experts"]
        assert max(abs(x - y) for x, y in zip(a["logprobs"][-8:], b["logprobs"][-8:], strict=True)) < 1e-4
    _, plain = run(tmp_path, "plain", "--url", live.base_url)
    check(plain, routing=False)


def test_a_trunk_that_ends_before_the_branch_point_is_written_alone(tmp_path, torch_one_thread) -> None:
    summary, records = run(tmp_path, "branched", "--branch-at", "1", "--max-model-len", "256")  # no tool call: the trunk ends at once
    assert summary["trajectories"] == 3 and [(r["group"], r["index"]) for r in records] == [(0, 0), (1, 0), (2, 0)]


def test_a_bad_task_file_is_refused(tmp_path, capsys) -> None:
    path = task_file(tmp_path, {**TASK, "verfiy": "true"})
    assert main(["rollout", "--task", str(path), "--out", str(tmp_path / "x.jsonl")]) == 2
    assert "unknown task keys ['verfiy']" in capsys.readouterr().err
    good = task_file(tmp_path, TASK)
    assert main(["rollout", "--task", str(good), "--out", str(tmp_path / "x.jsonl"), "--branch-at", "4", "--max-turns", "4"]) == 2
    assert "--branch-at=4: expected 0 < branch-at < --max-turns (4)" in capsys.readouterr().err

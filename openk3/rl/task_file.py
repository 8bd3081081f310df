"""Tasks from a JSON file, for `openk3 rollout`, and trajectories as JSON lines.

A task file is one JSON object: `task_id`, `prompt`, optionally `setup` (a shell command run once in the task's sandbox
before it is snapshotted), and `verify`, a shell command run in each finished episode's sandbox whose exit code 0 is reward
1.0 and anything else (a timeout, a refusal) 0.0 -- the reward runs inside the sandbox, as the task declares it -- and
optionally `documents`, a folder of pages shipped with the task (rl/documents.py), relative to the task file's folder,
which the search and open tools read (loaded and indexed here, once). Any other key is an error (a misspelt `verfiy` must
not leave a task without its reward).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from openk3.rl.documents import DocumentStore
from openk3.rl.episode import Task, Verifier
from openk3.rl.tools import Sandboxes
from openk3.rl.trajectory import Trajectory
from openk3.sandbox.protocol import SandboxError

TASK_KEYS = {"task_id": str, "prompt": str, "setup": str, "verify": str, "documents": str}
REQUIRED = ("task_id", "prompt", "verify")


def command_verifier(command: str, timeout_s: float = 60.0) -> Verifier:
    """Reward 1.0 when `command` exits 0 in the episode's sandbox, else 0.0."""

    def verify(sandboxes: Sandboxes, sandbox_id: str) -> float:
        try:
            result = sandboxes.exec(sandbox_id, command, timeout_s=timeout_s)
        except SandboxError:
            return 0.0
        return 1.0 if result.exit_code == 0 and not result.timed_out else 0.0

    return verify


def task_from_dict(spec: Any, where: str, folder: Path | None = None) -> Task:
    """The task `spec` describes; `folder`: where its `documents` path starts (the task file's folder)."""
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: a task is a JSON object, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(TASK_KEYS))
    if unknown:
        raise ValueError(f"{where}: unknown task keys {unknown}; a task has {sorted(TASK_KEYS)}")
    for key in REQUIRED:
        if key not in spec:
            raise ValueError(f"{where}: the task has no {key!r}")
    for key, kind in TASK_KEYS.items():
        if key in spec and not isinstance(spec[key], kind):
            raise ValueError(f"{where}: task {key!r} must be a string, got {spec[key]!r}")
    documents = None
    if "documents" in spec:
        if folder is None:
            raise ValueError(f"{where}: 'documents' is a folder relative to a task file; this task has none")
        documents = DocumentStore.from_folder(folder / spec["documents"])
    return Task(spec["task_id"], spec["prompt"], command_verifier(spec["verify"]), spec.get("setup"), documents)


def load_task(path: Path) -> Task:
    try:
        spec = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON: {e}") from e
    return task_from_dict(spec, str(path), path.parent)


def trajectory_record(t: Trajectory, group: int, with_routing: bool) -> dict[str, Any]:
    """One trajectory as a JSON object: exact ids, loss mask, logprobs (null where not sampled), reward, weight version,
    the shared trunk length, every turn's call and result, and the routed experts ([T][L][k]) when asked for."""
    record: dict[str, Any] = {
        "task_id": t.task_id,
        "group": group,
        "index": t.index,
        "token_ids": list(t.token_ids),
        "loss_mask": list(t.loss_mask),
        "logprobs": list(t.logprobs),
        "reward": t.reward,
        "weight_version": t.weight_version,
        "shared_prefix": t.shared_prefix,
        "turns": [
            {
                "tool": u.tool,
                "command": u.command,
                "status": None if u.status is None else u.status.value,
                "exit_code": u.exit_code,
                "cached_tokens": u.cached_tokens,
            }
            for u in t.turns
        ],
    }
    if with_routing:
        if t.routing is None:
            raise ValueError(f"trajectory {t.task_id}/{t.index}: routing was asked for but the policy returned none")
        record["routed_experts"] = {"layers": list(t.routing.layers), "experts": t.routing.experts_TLk.tolist()}
    return record

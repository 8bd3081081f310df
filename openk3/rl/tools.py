"""The agent's one tool, a shell in its sandbox: how a reply calls it (`<bash>command</bash>`), how the call runs, and what
the policy reads back. Nothing a reply or a sandbox does raises out of here: a malformed call, a refusal, a crash or a
timeout becomes an observation and a ToolStatus in the trajectory."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from openk3.rl.trajectory import ToolStatus
from openk3.sandbox.protocol import ExecResult, SandboxError, SnapshotInfo

OPEN, CLOSE = "<bash>", "</bash>"
CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
MAX_OBSERVATION_CHARS = 2000  # the tail of long output: what the policy reads must fit its context
MALFORMED_RESULT = (ToolStatus.MALFORMED, None, f"error: a tool call must be {OPEN}command{CLOSE}")  # run_call's form


class Sandboxes(Protocol):
    """What episodes use of openk3's sandboxes: SandboxService in process, or SandboxClient over HTTP."""

    def create(self, *args: Any, **kwargs: Any) -> str: ...

    def exec(self, sandbox_id: str, cmd: str | list[str], timeout_s: float = 60.0) -> ExecResult: ...

    def snapshot(self, source_id: str) -> SnapshotInfo: ...

    def fork(self, source_id: str, n: int) -> list[str]: ...

    def destroy(self, target_id: str) -> None: ...

    def delete_snapshot(self, snapshot_id: str) -> None: ...


@dataclass(frozen=True)
class ToolCall:
    command: str | None  # None when the call is malformed
    status: ToolStatus | None  # MALFORMED, or None for a well-formed call not yet run


def parse_call(reply: str) -> ToolCall | None:
    """The reply's first tool call; None for a reply that calls none (a final answer)."""
    found = CALL.search(reply)
    if found is not None:
        return ToolCall(found.group(1).strip(), None)
    if OPEN in reply:
        return ToolCall(None, ToolStatus.MALFORMED)
    return None


def run_call(sandboxes: Sandboxes, sandbox_id: str, command: str, timeout_s: float) -> tuple[ToolStatus, int | None, str]:
    """(status, exit code, observation text) of one command."""
    try:
        result = sandboxes.exec(sandbox_id, command, timeout_s=timeout_s)
    except SandboxError as e:
        return ToolStatus.REFUSED, None, f"error: {type(e).__name__}: {e}"
    text = (result.stdout + result.stderr).decode(errors="replace")[-MAX_OBSERVATION_CHARS:]
    if result.timed_out:
        return ToolStatus.TIMED_OUT, result.exit_code, f"{text}\n[timed out after {timeout_s:g} s]"
    return ToolStatus.OK, result.exit_code, f"{text}\n[exit code {result.exit_code}]"


def observation_text(body: str) -> str:
    """How an observation is framed in the context (the policy sees where the tool's words start and end)."""
    return f"\n<output>\n{body}\n</output>\n"

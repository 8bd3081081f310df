"""The agent's tools and how a reply calls them: a shell in its sandbox (`<bash>command</bash>`), and, when the task ships a
document store (rl/documents.py), `<search>query</search>` or `<search k="3">query</search>` (ranked doc ids, titles,
snippets) and `<open>doc_id</open>` or `<open page="2">doc_id</open>` (a page of a document and its links). A reply's
first complete call runs; what the policy reads back is framed by `observation_text`.

Nothing a reply, a sandbox or the store does raises out of here: a malformed call (an opened tag never closed), a call
with bad arguments (an unknown doc id, a page that does not exist, a bad `k`, a search or open in a task without a store),
a refusal, a crash or a timeout becomes an observation and a ToolStatus in the trajectory. The document tools run in the
runner's process, against the store read when the task was loaded: a doc id is a key of its table, never a path."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from openk3.rl.documents import DocumentStore, ToolInputError, format_hits, format_page
from openk3.rl.trajectory import ToolStatus
from openk3.sandbox.protocol import ExecResult, SandboxError, SnapshotInfo

TOOLS = ("bash", "search", "open")
ATTRIBUTES = {"bash": (), "search": ("k",), "open": ("page",)}
CALL = re.compile(r"<(bash|search|open)(\s[^>]*)?>(.*?)</\1>", re.DOTALL)
OPENING = re.compile(r"<(bash|search|open)[\s>]")
ATTRIBUTE = re.compile(r'\s*([A-Za-z_]+)="([^"]*)"')
NUMBER = re.compile(r"[0-9]{1,9}")
DEFAULT_K = 5
MAX_OBSERVATION_CHARS = 2000  # the tail of long output: what the policy reads must fit its context
STOP_STRINGS = tuple(f"</{t}>" for t in TOOLS)  # a reply ends at its call's closing tag (kept in the reply)
Result = tuple[ToolStatus, int | None, str]  # status, exit code (shell only), the observation's body


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
    tool: str  # one of TOOLS
    command: str | None  # the text between the tags: the shell command, the query, the doc id; None when malformed
    attributes: str = ""  # the opening tag's attributes as written (parsed by the tool that takes them)

    @property
    def malformed(self) -> bool:
        return self.command is None


def parse_call(reply: str) -> ToolCall | None:
    """The reply's first complete tool call; a malformed one when it opens a call it never closes; None when it calls
    none (a final answer)."""
    found = CALL.search(reply)
    if found is not None:
        return ToolCall(found.group(1), found.group(3).strip(), (found.group(2) or "").strip())
    opened = OPENING.search(reply)
    if opened is not None:
        return ToolCall(opened.group(1), None)
    return None


def malformed_result(call: ToolCall) -> Result:
    example = {"bash": "<bash>command</bash>", "search": "<search>query</search>", "open": "<open>doc_id</open>"}[call.tool]
    return ToolStatus.MALFORMED, None, f"error: a {call.tool} call must be {example} (the call was never closed)"


def run_tool(call: ToolCall, sandboxes: Sandboxes, sandbox_id: str, documents: DocumentStore | None, timeout_s: float) -> Result:
    """Run one parsed call: the shell in the branch's sandbox, or search / open in the task's document store."""
    if call.command is None:
        return malformed_result(call)
    try:
        options = attributes(call)
        if call.tool == "bash":
            return run_call(sandboxes, sandbox_id, call.command, timeout_s)
        if documents is None:
            raise ToolInputError(f"this task has no document store to {call.tool}")
        if call.tool == "search":
            k = number(options.get("k"), "k", DEFAULT_K)
            return ToolStatus.OK, None, format_hits(call.command, documents.search(call.command, k))
        return ToolStatus.OK, None, format_page(documents.open(call.command, number(options.get("page"), "page", 1)))
    except ToolInputError as e:
        return ToolStatus.INVALID, None, f"error: {e}"


def attributes(call: ToolCall) -> dict[str, str]:
    """The call's attributes, each one its tool takes, written once as name="value"."""
    out: dict[str, str] = {}
    rest = call.attributes
    while rest.strip():
        m = ATTRIBUTE.match(rest)
        if m is None:
            raise ToolInputError(f'{call.tool}: cannot read the attributes {rest[:80]!r}; write them as name="value"')
        name, value = m.groups()
        if name not in ATTRIBUTES[call.tool]:
            takes = ", ".join(ATTRIBUTES[call.tool]) or "none"
            raise ToolInputError(f"{call.tool} takes no attribute {name!r} (it takes: {takes})")
        if name in out:
            raise ToolInputError(f"{call.tool}: attribute {name!r} given twice")
        out[name] = value
        rest = rest[m.end() :]
    return out


def number(value: str | None, name: str, default: int) -> int:
    if value is None:
        return default
    if NUMBER.fullmatch(value.strip()) is None:
        raise ToolInputError(f"{name}={value[:40]!r}: expected a whole number")
    return int(value)


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

"""The worker ranks LocalEP spawns, watched from rank 0: a rank that dies is reported with its exit code and last error.

A spawned rank can die before it ever runs its rank's code -- the classic case is a script without an
`if __name__ == "__main__":` guard, whose spawned children import it again and fail on the nested spawn -- and rank 0,
waiting in `init_process_group` for it to connect, would then wait out the group's whole timeout. So before anyone joins
the group each worker says, over a pipe of its own, that it has started; rank 0 waits for those messages or for a
worker's process to end (its sentinel), whichever comes first, without polling, within a start-up deadline. A worker that
fails later sends its error on the same pipe before it exits, so whoever reports its death can say why.
"""

from __future__ import annotations

import multiprocessing.connection
import time
import traceback
from collections.abc import Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

STARTED = "started"


class RankStartError(RuntimeError):
    """A spawned rank died or did not start in time; the message names it, its exit code and its last error."""


def report_started(pipe: Connection) -> None:
    """In the worker, first thing: tell rank 0 this process runs its rank's code."""
    pipe.send(STARTED)


def report_error(pipe: Connection, error: BaseException) -> None:
    """In the worker, as it fails: its error's last line of traceback, for rank 0's report (best effort: rank 0 may be gone)."""
    try:
        pipe.send("".join(traceback.format_exception_only(type(error), error)).strip())
    except OSError:
        pass


class SpawnedRanks:
    """Ranks 1..N-1 as processes and the read ends of their pipes (index i: rank i + 1)."""

    def __init__(self, processes: Sequence[BaseProcess], pipes: Sequence[Connection]) -> None:
        self.processes, self.pipes = list(processes), list(pipes)
        self._last_error: dict[int, str] = {}

    def wait_started(self, timeout_s: float) -> None:
        """Return once every worker has reported that it started; raise RankStartError as soon as one has died first, or
        when `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        pending = set(range(len(self.processes)))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = ", ".join(str(i + 1) for i in sorted(pending))
                raise RankStartError(f"multi-rank start-up: rank(s) {ranks} did not start within {timeout_s:g} s")
            waitables: list = [self.pipes[i] for i in pending] + [self.processes[i].sentinel for i in pending]
            for ready in multiprocessing.connection.wait(waitables, left):
                for i in list(pending):
                    if ready is self.pipes[i] and self._read(i) == STARTED:
                        pending.discard(i)
            for i in list(pending):  # a sentinel fired, or the pipe closed: read what it said before it went
                if self.processes[i].exitcode is not None:
                    raise RankStartError(f"multi-rank start-up: {self.describe_death(i)}")

    def _read(self, i: int) -> str | None:
        try:
            message = self.pipes[i].recv()
        except (EOFError, OSError):
            return None
        if message != STARTED:
            self._last_error[i] = str(message)
        return str(message)

    def describe_death(self, i: int) -> str:
        """What is known of worker i's end: its exit code (or signal) and its last reported error."""
        process = self.processes[i]
        process.join(1.0)  # its sentinel has fired or is about to: collect the exit code
        while self.pipes[i].poll():
            if self._read(i) is None:
                break
        code = process.exitcode
        how = "is still running" if code is None else f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        said = self._last_error.get(i)
        if said is not None:
            return f"rank {i + 1} (pid {process.pid}) {how}; its last error: {said}"
        hint = (
            " before it reported anything (a script that creates LLM(tp=...) or LLM(ep=...) needs an "
            "`if __name__ == '__main__':` guard: spawned ranks import it again; the rank's own error is above, on stderr)"
        )
        return f"rank {i + 1} (pid {process.pid}) {how}{hint}"

    def dead_report(self) -> str | None:
        """The deaths of every worker that has ended, or None while all run."""
        dead = [self.describe_death(i) for i, p in enumerate(self.processes) if p.exitcode is not None]
        return "; ".join(dead) if dead else None

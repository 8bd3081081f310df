"""Standbys are bounded and never make a restore wait in a queue: builds are gated by events, instances are stand-ins."""

from __future__ import annotations

import threading
from typing import Any

from openk3.sandbox.namespace.standby import Standbys


class Gated:
    """A build that blocks until `go` is set, returning a fresh stand-in instance; counts how often it ran."""

    def __init__(self, name: str, go: threading.Event) -> None:
        self.name = name
        self.go = go
        self.started = threading.Event()
        self.runs = 0

    def __call__(self) -> Any:
        self.started.set()
        self.runs += 1
        assert self.go.wait(30), "the test never released the build"
        return f"instance-{self.name}"


def test_bounded_standbys_and_no_wait_behind_the_queue():
    released: list[Any] = []
    standbys = Standbys(released.append, workers=1, max_ready=2)
    go = threading.Event()
    builds = {name: Gated(name, go) for name in ("s1", "s2", "s3")}
    for name in ("s1", "s2", "s3"):
        standbys.prepare(name, "params", builds[name])
    assert builds["s1"].started.wait(30)  # the one worker runs s1; s2 and s3 wait in the queue
    # max_ready=2: preparing s3 evicted s1, the oldest (its build runs, so it is torn down once built)
    assert standbys.take("s1", "params") is None
    # s3 is queued behind s2: taking it cancels its build (the caller builds in line) instead of waiting for the queue
    assert standbys.take("s3", "params") is None and builds["s3"].runs == 0
    go.set()
    assert builds["s2"].started.wait(30)
    assert standbys.take("s2", "params") == "instance-s2"  # a build already running is waited for
    standbys.wait("s1")
    assert released == ["instance-s1"]
    standbys.close()
    assert builds["s3"].runs == 0 and released == ["instance-s1"]

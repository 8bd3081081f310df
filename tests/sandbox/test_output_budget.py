"""Background output within one daemon-wide budget: a flood drops its own oldest bytes, offsets stay absolute, the daemon
says what was dropped (in ProcessStatus, ProcessOutput and /metrics), and many floods together never keep more than it."""

from __future__ import annotations

import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from openk3.sandbox.api.background import BackgroundProcesses
from openk3.sandbox.api.client import SandboxClient
from openk3.sandbox.api.output_budget import BLOCK, OutputBudget
from openk3.sandbox.api.server import create_app
from openk3.sandbox.protocol import InvalidArgument
from tests.sandbox.test_api import running

MIB = 1 << 20


def metric(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """One sample of a Prometheus text answer; fails naming it when absent."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == (labels or {}):
                return sample.value
    raise AssertionError(f"no sample {name}{labels or ''} in /metrics")


def pattern(n: int, seed: int) -> bytes:
    """Bytes whose every position is recognisable (so a wrong offset shows), not a repeated block."""
    return bytes((i * 7 + seed + (i >> 8)) % 251 for i in range(n))


def test_a_flood_drops_its_own_oldest_bytes_and_keeps_offsets_absolute():
    budget = OutputBudget(MIB)
    quiet, loud = budget.stream(), budget.stream()
    budget.append(quiet, b"quiet line\n")
    written = b""
    for i in range(50):  # 50 x 50,000 bytes into a 1 MiB budget, in chunks that do not align with blocks
        chunk = pattern(50_000, i)
        budget.append(loud, chunk)
        written += chunk
        budget.check_integrity()
    assert budget.buffered_bytes == MIB  # full, not over
    assert budget.read(quiet, 0, 100) == (0, b"quiet line\n")  # the flood dropped its own bytes, not the quiet stream's
    start, end = budget.offsets(loud)
    assert end == len(written) == 2_500_000 and start == end - (MIB - 11)
    assert budget.dropped_bytes == start
    skipped, data = budget.read(loud, 0, 1000)  # a poller still at offset 0 learns how much it missed
    assert skipped == start and data == written[start : start + 1000]
    assert budget.read(loud, start + 123_457, 70_000) == (0, written[start + 123_457 : start + 193_457])  # across blocks
    assert budget.read(loud, end, 10) == (0, b"")
    budget.release(loud)
    assert budget.buffered_bytes == 11 and budget.dropped_bytes == start  # releasing is not dropping
    budget.append(loud, b"late")  # a process still printing after its handle went: ignored
    budget.check_integrity()


def test_the_largest_streams_pay_and_small_writes_share_blocks():
    budget = OutputBudget(MIB)
    a, b, c = budget.stream(), budget.stream(), budget.stream()
    budget.append(a, bytes(600_000))
    budget.append(b, bytes(400_000))
    budget.append(c, bytes(100_000))  # over by 51,424 bytes: taken from a, the largest
    assert budget.offsets(a)[0] == 1_100_000 - MIB and budget.offsets(b)[0] == 0 and budget.offsets(c)[0] == 0
    for _ in range(BLOCK):
        budget.append(c, b"x")
    assert len(c.blocks) <= 4  # 65,536 one-byte writes did not become 65,536 objects
    big = pattern(3 * MIB, 1)  # one chunk larger than the whole budget keeps its newest MiB
    budget.append(b, big)
    assert budget.read(b, 0, 2 * MIB) == (400_000 + 2 * MIB, big[-MIB:]) and budget.buffered_bytes == MIB
    budget.check_integrity()
    with pytest.raises(InvalidArgument, match="output_budget_bytes=1000: expected >= 1048576"):
        OutputBudget(1000)


@pytest.mark.sandbox
def test_background_floods_stay_within_the_daemon_budget(svc, monkeypatch):
    """6 spawns each printing 16 MiB into a 4 MiB budget: the daemon never keeps more than 4 MiB, every process reports what
    it dropped, the newest bytes survive, and /metrics shows the budget, the bytes kept and the bytes dropped."""
    small = BackgroundProcesses(svc.backend, output_budget_bytes=4 * MIB)
    monkeypatch.setattr(svc, "background", small)  # the server reads the service's table: this one has a small budget
    sid = svc.create()
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], small.budget.buffered_bytes)
            small.budget.check_integrity()

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        with running(create_app(svc, workers=2, reap_interval_s=None)) as url, SandboxClient(url) as client:
            watcher.start()
            # 16 MiB of lines "<process> <line number>", so the tail that survives can be checked byte for byte
            cmd = 'seq -f "$P %.0f" 3000000 | head -c 16777216'
            pids = [client.spawn(sid, cmd, env={"P": str(p)}, max_output_bytes=64 * MIB) for p in range(6)]
            for p in pids:
                client.process_wait(p, timeout_s=300)
            finals = [client.process_status(p) for p in pids]  # after all ended: a flood drops a finished stream's bytes too
            stop.set()
            watcher.join()
            assert peak[0] <= 4 * MIB and small.budget.buffered_bytes <= 4 * MIB
            for p, st in enumerate(finals):
                assert not st.running and st.exit_code == 0 and st.stdout_bytes == 16 * MIB, st
                assert st.stdout_dropped >= 12 * MIB and st.stderr_dropped == 0
                out = client.process_output(pids[p], 0, 0, max_bytes=64 * MIB)
                assert out.stdout_dropped == st.stdout_dropped and out.stdout_offset == 16 * MIB
                last = out.stdout.rsplit(b"\n", 2)[-2]  # the last whole line: the newest bytes were kept
                assert last.startswith(f"{p} ".encode()) and len(out.stdout) == 16 * MIB - st.stdout_dropped
            scraped = httpx.get(f"{url}/metrics").text
            assert metric(scraped, "openk3_sandbox_output_budget_bytes") == 4 * MIB
            assert metric(scraped, "openk3_sandbox_output_buffered_bytes") <= 4 * MIB
            assert metric(scraped, "openk3_sandbox_output_dropped_bytes_total") == sum(st.stdout_dropped for st in finals)
            assert metric(scraped, "openk3_sandbox_background_processes", {"state": "finished"}) == 6
            assert metric(scraped, "openk3_sandbox_sandboxes") == 1
    finally:
        stop.set()
        svc.destroy(sid)
    assert small.budget.buffered_bytes == 0 and small.ids() == []  # destroy released every handle's bytes

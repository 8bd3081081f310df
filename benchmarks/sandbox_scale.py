"""Sandbox scale (issue 18 item 11): squashing a deep snapshot chain, and standbys after a burst of snapshots.

Squash: an image layer (a 2,000-file / 50 MB tree) under a chain of `max_layers` small snapshot layers; the baseline squashes
the whole stack into one layer (what the daemon did before), the daemon now squashes the upper half and keeps the bottom
layers (the image) shared. Gate: a sandbox over each squashed stack must show the same tree (digest) as one over the chain.

Burst: one sandbox takes `--burst` snapshots in a row, each of which prepares a standby; then it is restored to the last.
Baseline: standbys unbounded (max_standbys=4096) and the restore waiting for its snapshot's queued standby build (the old
behaviour); now: max_standbys=16, and a restore cancels a standby build that is still queued and builds in line.
Reported: standbys alive after the burst, and the restore's latency. Needs root.

    sudo .venv/bin/python benchmarks/sandbox_scale.py
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from openk3.sandbox.api.service import SandboxService  # noqa: E402
from openk3.sandbox.fs import tree  # noqa: E402
from openk3.sandbox.linux import syscalls  # noqa: E402
from openk3.sandbox.namespace.settings import BackendConfig  # noqa: E402
from openk3.sandbox.protocol import Limits  # noqa: E402


def image_tar(files: int, total_bytes: int) -> bytes:
    raw = io.BytesIO()
    size = total_bytes // files
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for i in range(files):
            info = tarfile.TarInfo(f"env/d{i % 50:02d}/f{i:04d}")
            info.size = size
            tar.addfile(info, io.BytesIO(os.urandom(size)))
    return raw.getvalue()


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def view_digest(svc: SandboxService, digests: tuple[str, ...]) -> str:
    snap = svc.backend.register_snapshot(list(digests), [])
    sid = svc.create(snap.snapshot_id)
    try:
        return tree.tree_digest(svc.backend.merged_root(sid))
    finally:
        svc.destroy(sid)
        svc.delete_snapshot(snap.snapshot_id)


def squash(args: argparse.Namespace, svc: SandboxService, gate: list[str]) -> dict[str, float]:
    builder = svc.create(limits=Limits(disk_bytes=256 * 2**20, memory_bytes=1 << 30))
    svc.upload_tar(builder, image_tar(args.files, args.bytes), "/work")
    snap = svc.backend.snapshot(builder, prewarm=False)
    svc.destroy(builder)
    made = [snap.snapshot_id]
    depth = svc.backend.config.max_layers
    for i in range(depth - 1):  # a chain: each step a sandbox over the last snapshot, one small edit, a snapshot
        sid = svc.create(made[-1])
        svc.exec(sid, f"echo {i} >> /work/env/d{i % 50:02d}/f{i:04d}; rm -f /work/env/d01/f{(i * 7) % 2000:04d}; echo {i} > /work/step")
        made.append(svc.backend.snapshot(sid, prewarm=False).snapshot_id)
        svc.destroy(sid)
    layers = svc.backend.snapshot_info(made[-1]).layers
    assert len(layers) == depth, (len(layers), depth)
    keep = depth // 2
    times: dict[str, list[float]] = {"whole stack": [], "upper half": []}
    results: dict[str, tuple[str, ...]] = {}
    for r in range(args.repeats):
        for name, bottom, top in (("whole stack", (), layers), ("upper half", layers[:keep], layers[keep:])):
            t0 = time.perf_counter()
            layer = svc.backend.store.add_squash(list(top))
            times[name].append(ms(t0))
            if r < args.repeats - 1:
                svc.backend.store.decref([layer.digest])  # deleted, so the next repeat writes it afresh
            else:
                svc.backend.store.incref(bottom)  # the squashed stack is held while the views are compared below
                results[name] = tuple(bottom) + (layer.digest,)
    reference = view_digest(svc, layers)
    for name, stack in results.items():
        if view_digest(svc, stack) != reference:
            gate.append(f"squash ({name}): the sandbox's tree differs from the chain's")
        svc.backend.store.decref(stack)
    for s in made:
        svc.delete_snapshot(s)
    return {name: statistics.median(v) for name, v in times.items()}


def restore_after_burst(args: argparse.Namespace, max_standbys: int, wait_for_queue: bool, gate: list[str]) -> float:
    """Latency of a restore right after `--burst` snapshots; `wait_for_queue` first waits for the restored snapshot's standby
    build however far back in the queue it is, as the daemon's restore did before it cancelled queued builds."""
    state = tempfile.mkdtemp(prefix="openk3-bench-scale-")
    svc = SandboxService(BackendConfig(state_dir=state, store_bytes=2 * 2**30, max_standbys=max_standbys))
    try:
        sid = svc.create()
        snaps = []
        for i in range(args.burst):
            svc.exec(sid, f"echo {i} > /root/n")
            snaps.append(svc.snapshot(sid).snapshot_id)
        t0 = time.perf_counter()
        if wait_for_queue:
            svc.backend.standbys._ready[snaps[-1]][1].result()
        svc.restore(sid, snaps[-1])
        restore_ms = ms(t0)
        if svc.exec(sid, "cat /root/n").stdout != f"{args.burst - 1}\n".encode():
            gate.append(f"burst (max_standbys={max_standbys}): the restored sandbox shows the wrong file")
        for s in snaps:
            svc.delete_snapshot(s)
        svc.destroy(sid)
        return restore_ms
    finally:
        svc.close()


def standbys_after_burst(args: argparse.Namespace, max_standbys: int) -> int:
    """Sandbox mounts left once the burst's background builds are done: one per standby (plus the sandbox's own)."""
    state = tempfile.mkdtemp(prefix="openk3-bench-scale-")
    svc = SandboxService(BackendConfig(state_dir=state, store_bytes=2 * 2**30, max_standbys=max_standbys))
    try:
        sid = svc.create()
        snaps = []
        for i in range(args.burst):
            svc.exec(sid, f"echo {i} > /root/n")
            snaps.append(svc.snapshot(sid).snapshot_id)
        for s in list(svc.backend.standbys._ready):  # wait for every build still listed, without taking it
            svc.backend.standbys._ready[s][1].result()
        boxes = [p for p in syscalls.mounts_under(os.path.join(svc.backend.state, "sbx")) if not p.endswith("/m")]
        for s in snaps:
            svc.delete_snapshot(s)
        svc.destroy(sid)
        return len(boxes) - 1
    finally:
        svc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--bytes", type=int, default=50 * 2**20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--burst", type=int, default=100)
    args = parser.parse_args()
    gate: list[str] = []
    state = tempfile.mkdtemp(prefix="openk3-bench-scale-")
    svc = SandboxService(BackendConfig(state_dir=state, store_bytes=4 * 2**30, prewarm=False))
    try:
        sq = squash(args, svc, gate)
    finally:
        svc.close()
    before_n, after_n = standbys_after_burst(args, 4096), standbys_after_burst(args, 16)
    before_ms = restore_after_burst(args, 4096, True, gate)
    after_ms = restore_after_burst(args, 16, False, gate)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"command: {' '.join(sys.argv)}\nmachine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, kernel {platform.release()}")
    print(f"commit: {commit} (plus the working tree)\n")
    if gate:
        print("CORRECTNESS GATE FAILED, no ratios reported:\n  " + "\n  ".join(gate))
        sys.exit(1)
    print("| measurement | before (baseline) | now | ratio |\n|---|---|---|---|")
    print(
        f"| squash of a {svc.backend.config.max_layers}-layer chain over a {args.files}-file / {args.bytes >> 20} MB image, median of {args.repeats} "
        f"| {sq['whole stack']:.1f} ms (whole stack) | {sq['upper half']:.1f} ms (upper half) | {sq['whole stack'] / sq['upper half']:.1f}x |"
    )
    print(f"| standbys alive after {args.burst} snapshots | {before_n} (max_standbys=4096) | {after_n} (max_standbys=16) | - |")
    print(f"| restore right after {args.burst} snapshots | {before_ms:.1f} ms | {after_ms:.1f} ms | {before_ms / after_ms:.1f}x |")


if __name__ == "__main__":
    main()

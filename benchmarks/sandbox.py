"""Sandbox lifecycle latencies over HTTP, as a caller sees them, with an empty and a 2,000-file / 50 MB workspace.

The daemon is a real `openk3 sandbox serve` process; the client is `SandboxClient` over loopback HTTP. Per workspace, each
cycle: create (over the workspace's image), exec a small edit, snapshot, exec another edit, restore, fork one sandbox from
the snapshot, destroy both. A correctness gate (the workspace's listing with sizes after restore equals the listing at
snapshot) runs on the first and last cycles; no ratio is reported if it fails. Baselines in the same run: `cp -a` of the
same workspace on tmpfs (what a full-copy snapshot costs), and a process-memory snapshot of the built-in Python env.

`--daemon-code DIR` runs the daemon from another checkout with this script's client; `--vs DIR` runs a second daemon from
DIR (say the commit before a change) beside it and alternates every cycle between the two, so a before/after on a shared,
noisy host compares the same moments, not two runs' loads. Needs root (see docs/sandbox.md).

    sudo .venv/bin/python benchmarks/sandbox.py --cycles 100 --out benchmarks/results/sandbox.md

What a snapshot holds: an openk3 fs snapshot is the sandbox's files (a content-addressed change-set layer over its image),
and a process snapshot is the memory of one registered Python environment. Neither is the memory of arbitrary processes:
a restored sandbox starts its processes afresh. A VM snapshot (K3's published 133 ms snapshot / 49 ms restore) captures
memory as well, so the figures below are not comparable with it and this script reports no ratio against them.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from openk3.sandbox.api.client import SandboxClient  # noqa: E402

EDIT_1 = "mkdir -p /work/env && echo edit >> /work/env/new.txt && echo one > /work/scratch"
EDIT_2 = "rm -rf /work/env/d02 && echo other >> /work/env/new.txt && echo x > /work/scratch"
# Listing with sizes and link targets: what the gate compares (the daemon's tree digest is not an API).
LISTING = "cd /work && find . -printf '%p %y %s %m %l\\n' | LC_ALL=C sort | md5sum"
SERVE = "import sys; from openk3.cli import main; sys.exit(main())"
OPS = ("create", "exec", "snapshot", "restore", "fork", "destroy")


def env_archive(files: int, total_bytes: int) -> bytes:
    raw = io.BytesIO()
    size = total_bytes // files if files else 0
    with tarfile.open(fileobj=raw, mode="w") as tar:
        for i in range(files):
            info = tarfile.TarInfo(f"env/d{i % 50:02d}/f{i:04d}")
            info.size = size
            tar.addfile(info, io.BytesIO(os.urandom(64) * (size // 64) + b"\0" * (size % 64)))
    return raw.getvalue()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def timed(bucket: list[float], fn, *args, **kwargs):
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    bucket.append((time.perf_counter() - t0) * 1000)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(code: str, state: str, port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-c", SERVE, "sandbox", "serve", "--port", str(port), "--state-dir", state, "--store-bytes", str(4 * 2**30)]
    # cwd too: `python -c` puts the working directory first on sys.path, before PYTHONPATH
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": code}, cwd=code, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            assert proc.stderr is not None
            sys.exit(f"the daemon exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/health").json().get("ok"):
                return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    sys.exit("the daemon did not answer /v1/health within 120 s")


def lifecycle(c: SandboxClient, image: str | None, i: int, cycles: int, t: dict[str, list[float]], gate: list[str], label: str) -> None:
    """Cycle `i` of `cycles`: create, edit, snapshot, edit, restore, fork, destroy both (the gate on the first and last)."""
    sid = timed(t["create"], c.create, image)
    timed(t["exec"], c.exec, sid, EDIT_1)
    check = i in (0, cycles - 1)
    before = c.exec(sid, LISTING).stdout if check else None
    snap = timed(t["snapshot"], c.snapshot, sid)
    c.exec(sid, EDIT_2)
    timed(t["restore"], c.restore, sid, snap.snapshot_id)
    if check and c.exec(sid, LISTING).stdout != before:
        gate.append(f"{label}, cycle {i}: the workspace after restore differs from the one at snapshot")
    (child,) = timed(t["fork"], c.fork, snap.snapshot_id, 1)
    if check and c.exec(child, LISTING).stdout != before:
        gate.append(f"{label}, cycle {i}: the fork's workspace differs from the snapshot")
    timed(t["destroy"], c.destroy, child)
    timed(t["destroy"], c.destroy, sid)
    c.delete_snapshot(snap.snapshot_id)


def build_image(c: SandboxClient, archive: bytes) -> str:
    builder = c.create(limits=None)
    c.exec(builder, "mkdir -p /work")
    c.upload_tar(builder, archive, "/work")
    image = c.snapshot(builder).snapshot_id
    c.destroy(builder)
    return image


def full_copy_baseline(archive: bytes, cycles: int) -> list[float]:
    """`cp -a` of the same workspace, tmpfs to tmpfs: what a snapshot that copies every file costs."""
    scratch = tempfile.mkdtemp(prefix="openk3-bench-copy-", dir="/dev/shm")
    try:
        src = os.path.join(scratch, "src")
        os.mkdir(src)
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(src, filter="data")
        out: list[float] = []
        for _ in range(cycles):
            timed(out, subprocess.run, ["cp", "-a", src, os.path.join(scratch, "dst")], check=True)
            shutil.rmtree(os.path.join(scratch, "dst"))
        return out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run(args: argparse.Namespace) -> str:
    load_before = os.getloadavg()
    state = tempfile.mkdtemp(prefix="openk3-bench-state-", dir="/tmp")
    os.chmod(state, 0o755)  # bwrap runs as the sandbox uid and must traverse it (docs/sandbox.md, Root)
    port = free_port()
    daemon = start_daemon(args.daemon_code, state, port)
    workspaces = {"empty": (0, 0), f"{args.files} files / {args.bytes // 2**20} MB": (args.files, args.bytes)}
    t: dict[str, dict[str, list[float]]] = {w: {op: [] for op in OPS} for w in workspaces}
    extra: dict[str, list[float]] = {"process snapshot": [], "process restore": [], "process fork": []}
    gate: list[str] = []
    try:
        c = SandboxClient(f"http://127.0.0.1:{port}")
        for label, (files, nbytes) in workspaces.items():
            image = None
            if files:
                archive = env_archive(files, nbytes)
                image = build_image(c, archive)
                extra[f"cp -a, {label} (baseline)"] = full_copy_baseline(archive, args.baseline_cycles)
            for i in range(args.cycles):
                lifecycle(c, image, i, args.cycles, t[label], gate, label)
            if image:
                c.delete_snapshot(image)
        eid = c.create_env("demo", {"ballast_mb": args.process_mb})
        c.call_env(eid, "step", [1])
        for i in range(args.cycles):
            psnap = timed(extra["process snapshot"], c.snapshot, eid, kind="process")
            expected = c.call_env(eid, "state")
            c.call_env(eid, "step", [1])
            timed(extra["process restore"], c.restore, eid, psnap.snapshot_id)
            if i in (0, args.cycles - 1) and c.call_env(eid, "state") != expected:
                gate.append(f"process cycle {i}: state after restore differs from the snapshot")
            (copy,) = timed(extra["process fork"], c.fork, psnap.snapshot_id, 1)
            c.destroy(copy)
            c.delete_snapshot(psnap.snapshot_id)
        c.destroy(eid)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(timeout=120)
        shutil.rmtree(state, ignore_errors=True)
    return report(args, t, extra, gate, load_before, os.getloadavg())


def run_ab(args: argparse.Namespace) -> str:
    """Two daemons at once, this checkout's (`after`) and `--vs`'s (`before`), each cycle run on both in turn (the order
    alternating), so both see the same machine: on a shared, noisy host a before/after from separate runs compares loads."""
    load_before = os.getloadavg()
    codes = {"before": args.vs, "after": args.daemon_code}
    daemons, clients, states = {}, {}, []
    workspaces = {"empty": (0, 0), f"{args.files} files / {args.bytes // 2**20} MB": (args.files, args.bytes)}
    t = {name: {w: {op: [] for op in OPS} for w in workspaces} for name in codes}
    gate: list[str] = []
    try:
        for name, code in codes.items():
            state = tempfile.mkdtemp(prefix=f"openk3-bench-{name}-", dir="/tmp")
            os.chmod(state, 0o755)
            states.append(state)
            port = free_port()
            daemons[name] = start_daemon(code, state, port)
            clients[name] = SandboxClient(f"http://127.0.0.1:{port}")
        for label, (files, nbytes) in workspaces.items():
            archive = env_archive(files, nbytes) if files else None
            images = {name: build_image(c, archive) if archive else None for name, c in clients.items()}
            for i in range(args.cycles):
                for name in ("before", "after") if i % 2 == 0 else ("after", "before"):
                    lifecycle(clients[name], images[name], i, args.cycles, t[name][label], gate, f"{name}, {label}")
            for name, image in images.items():
                if image:
                    clients[name].delete_snapshot(image)
    finally:
        for d in daemons.values():
            d.send_signal(signal.SIGTERM)
        for d in daemons.values():
            d.wait(timeout=120)
        for state in states:
            shutil.rmtree(state, ignore_errors=True)
    load_after = os.getloadavg()
    commit = {n: subprocess.run(["git", "-C", c, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() for n, c in codes.items()}
    lines = [
        "# Sandbox lifecycle over HTTP, before/after in one run",
        "",
        f"Command: `{' '.join(sys.argv)}`  ",
        f"Machine: {platform.node()}, kernel {platform.release()}, {os.cpu_count()} cores, load average {load_before[0]:.1f} before / "
        f"{load_after[0]:.1f} after; before = daemon at {commit['before']}, after = daemon at {commit['after']}; {args.cycles} cycles "
        "each, alternating.",
        "",
        "| workspace | operation | before p50 ms | after p50 ms | after/before p50 | before p99 ms | after p99 ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label in workspaces:
        for op in OPS:
            b, a = t["before"][label][op], t["after"][label][op]
            pb, pa = statistics.median(b), statistics.median(a)
            lines.append(f"| {label} | {op} | {pb:.2f} | {pa:.2f} | {pa / pb:.2f} | {pct(b, 0.99):.2f} | {pct(a, 0.99):.2f} |")
    if gate:
        lines += ["", "**Correctness gate failed:**", *[f"- {g}" for g in gate]]
    return "\n".join(lines) + "\n"


def report(args, t, extra, gate, load_before, load_after) -> str:
    commit = subprocess.run(["git", "-C", args.daemon_code, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        "# Sandbox lifecycle benchmark (over HTTP)",
        "",
        f"Command: `{' '.join(sys.argv)}`  ",
        f"Machine: {platform.node()}, kernel {platform.release()}, {os.cpu_count()} cores, load average "
        f"{load_before[0]:.1f} before / {load_after[0]:.1f} after; daemon code at commit {commit or '?'}; {args.cycles} cycles.",
        "",
        "| workspace | operation | p50 ms | p99 ms | n |",
        "|---|---|---:|---:|---:|",
    ]
    for label, ops in t.items():
        for op, v in ops.items():
            if v:
                lines.append(f"| {label} | {op} | {statistics.median(v):.2f} | {pct(v, 0.99):.2f} | {len(v)} |")
    for name, v in extra.items():
        if v:
            lines.append(f"| - | {name} | {statistics.median(v):.2f} | {pct(v, 0.99):.2f} | {len(v)} |")
    lines.append("")
    if gate:
        lines += ["**Correctness gate failed; no ratios reported:**", *[f"- {g}" for g in gate]]
        return "\n".join(lines) + "\n"
    big = [w for w in t if w != "empty"][0]
    copy = statistics.median(extra[f"cp -a, {big} (baseline)"])
    snap = statistics.median(t[big]["snapshot"])
    lines += [
        f"fs snapshot of the {big} workspace over HTTP vs `cp -a` of it (same run): {snap:.2f} ms vs {copy:.2f} ms, {copy / snap:.1f}x.",
        "",
        "What these snapshots hold: an fs snapshot is the sandbox's files (its change set as a content-addressed layer over "
        "its image), a process snapshot the memory of one registered Python environment. Neither holds the memory of "
        "arbitrary processes (a restored sandbox restarts them), so these figures are not comparable with a VM snapshot "
        "that captures memory, such as K3's published 133 ms snapshot / 49 ms restore.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--baseline-cycles", type=int, default=10)
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--bytes", type=int, default=50 * 2**20)
    parser.add_argument("--process-mb", type=int, default=100)
    parser.add_argument("--daemon-code", default=ROOT, help="checkout whose openk3 package the daemon runs (default: this one)")
    parser.add_argument("--vs", default=None, metavar="DIR", help="also run a daemon from checkout DIR, alternating cycles with this one (before/after)")
    parser.add_argument("--out", default=None, help="also write the table to this markdown file")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("benchmarks/sandbox.py needs root (overlay mounts and cgroups)")
    text = run_ab(args) if args.vs else run(args)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()

"""What this host can do for namespace sandboxes, checked once when a backend starts (and by the test suite's skip).

The check ends with a real bwrap start with every namespace and option the backend uses, because a kernel can list a feature
and still refuse it (user namespaces disabled by sysctl, overlay missing in a container, a seccomp profile denying unshare).
Each missing piece is a refusal with its reason, never a sandbox with that protection silently left out.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess

from openk3.sandbox.linux import helper, seccomp
from openk3.sandbox.linux.cgroups import Layout, detect_layout

# bwrap options without which a sandbox would be weaker than docs/sandbox.md says (--disable-userns: bubblewrap >= 0.8)
BWRAP_OPTIONS = ("--disable-userns", "--seccomp", "--bind-fd", "--remount-ro", "--clearenv", "--unshare-cgroup", "--cap-drop")


@dataclasses.dataclass(frozen=True)
class HostFeatures:
    kernel: str
    layout: Layout
    bwrap: str  # absolute path, resolved from the system directories once
    unavailable_reason: str | None  # None when every feature the backend needs works


def _filesystems() -> set[str]:
    with open("/proc/filesystems") as f:
        return {line.split()[-1] for line in f if line.strip()}


def probe() -> HostFeatures:
    kernel = os.uname().release
    layout = detect_layout()
    bwrap = helper.host_binary("bwrap") or ""

    def result(reason: str | None) -> HostFeatures:
        return HostFeatures(kernel=kernel, layout=layout, bwrap=bwrap, unavailable_reason=reason)

    if os.geteuid() != 0:
        return result("not root: mounting overlays and writing cgroups needs root (run as root or in CI)")
    if not bwrap:
        return result("bwrap not found: install bubblewrap (`make system-deps` or apt-get install bubblewrap)")
    try:
        helper.compiler()
        seccomp.host_arch()
    except (helper.Unsupported, OSError) as e:
        return result(str(e))
    usage = subprocess.run([bwrap, "--help"], capture_output=True, text=True, check=False, env=helper.HOST_ENV).stdout
    lacking = [o for o in BWRAP_OPTIONS if o not in usage]
    if lacking:
        return result(f"{bwrap} lacks {lacking} (needs bubblewrap >= 0.8)")
    missing = {"overlay", "tmpfs"} - _filesystems()
    if missing:
        return result(f"kernel lacks filesystems {sorted(missing)} (modprobe overlay?)")
    if layout.control_root is None:
        return result("no cgroup v2 tree and no v1 freezer: sandboxes could not be frozen or killed as a whole")
    try:
        with open("/proc/sys/user/max_user_namespaces") as f:
            if int(f.read()) == 0:
                return result("user namespaces disabled (user.max_user_namespaces = 0)")
    except FileNotFoundError:
        return result("kernel without user namespaces")
    smoke = subprocess.run(
        [
            bwrap,
            "--unshare-user",
            "--disable-userns",
            "--unshare-cgroup",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-ipc",
            "--unshare-uts",
            "--uid",
            "0",
            "--gid",
            "0",
            "--ro-bind",
            "/",
            "/",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--cap-drop",
            "ALL",
            "--",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
        env=helper.HOST_ENV,
    )
    if smoke.returncode != 0:
        return result(f"bwrap cannot create namespaces here: {smoke.stderr.strip()}")
    return result(None)

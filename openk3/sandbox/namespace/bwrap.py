"""The bwrap command line of a sandbox's init: every namespace, the root and /dev/shm by fd, and the hardening options.

Each option is required (host.py refuses to start without them): `--disable-userns` nests the sandbox's user namespace one
level deeper with a limit of one child, so nothing inside can create another; `--seccomp` loads linux/seccomp.py's filter;
`--unshare-cgroup` roots a cgroup namespace at the sandbox's cgroup (openk3-enter has moved bwrap there before this runs);
`--remount-ro /dev` because bwrap's /dev is a tmpfs of half the host's memory that the sandbox's root could fill (its
/dev/shm is a directory of the sandbox's own quota tmpfs instead); `--clearenv` so the init sees only the variables given;
`--cap-drop ALL` because bwrap started by real root (sandbox_uid None) keeps every capability for the sandbox by default,
and the init is the sandbox's own bash: with it, the init has no capability whichever uid bwrap runs as.
"""

from __future__ import annotations


def init_argv(bwrap: str, root_fd: int, shm_fd: int, filter_fd: int, info_fd: int, env: dict[str, str], command: list[str]) -> list[str]:
    setenv = [part for key, value in env.items() for part in ("--setenv", key, value)]
    return [
        bwrap,
        "--unshare-user", "--disable-userns", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
        "--uid", "0", "--gid", "0", "--hostname", "sandbox",
        "--bind-fd", str(root_fd), "/",
        "--proc", "/proc",
        "--dev", "/dev",
        "--bind-fd", str(shm_fd), "/dev/shm",
        "--remount-ro", "/dev",
        "--cap-drop", "ALL",
        "--clearenv", *setenv,
        "--seccomp", str(filter_fd),
        "--new-session", "--as-pid-1",
        "--info-fd", str(info_fd),
        "--chdir", "/",
        "--", *command,
    ]  # fmt: skip

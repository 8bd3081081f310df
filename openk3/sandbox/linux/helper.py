"""Building `openk3-enter` (helper_source.py) and the command lines that start processes through it.

Every host-side hop runs with a fixed environment and absolute paths found at start-up: the daemon never looks a program up
in a caller's PATH, and a caller's variables (LD_PRELOAD, PATH, ...) reach only the command, inside the sandbox, where the
helper's final execve applies them; they travel to it in a memfd (`command_spec`), never on a command line, which any host
user can read in /proc/<pid>/cmdline. The binary is compiled once per host (a few hundred ms) with the system C compiler and
static libc, and cached under the daemon's cache dir by a hash of its source and compiler, readable only by root; that dir
must be private to root (`check_private_dir`), or whoever could write it would choose the program the daemon runs as root.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile

from openk3.sandbox.linux.helper_source import C_SOURCE
from openk3.sandbox.protocol import InvalidArgument, Unsupported

logger = logging.getLogger(__name__)

ENTER_FAILED = 125  # the helper's exit status when it could not enter (nothing of the command ran)
ENTER_ERROR_PREFIX = b"openk3-enter: "
# The only environment a host-side process of the daemon gets (bwrap, the helper); nothing of it reaches a sandbox.
HOST_ENV: dict[str, str] = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C"}
HOST_BIN = "/usr/sbin:/usr/bin:/sbin:/bin"
COMPILE_FLAGS = ("-static", "-O2", "-Wall")


def host_binary(name: str) -> str | None:
    """Absolute, symlink-free path of a host tool from the system directories only (never the daemon's PATH)."""
    path = shutil.which(name, path=HOST_BIN)
    return os.path.realpath(path) if path else None


def compiler() -> str:
    for name in ("cc", "gcc", "clang"):
        found = host_binary(name)
        if found:
            return found
    raise Unsupported("no C compiler (cc, gcc or clang) to build openk3-enter: apt-get install gcc libc6-dev")


def check_private_dir(path: str, field: str) -> None:
    """Create `path` (0700) if missing, then refuse it unless only root can change it: it and each ancestor must be root-owned
    and writable by root only, except sticky ancestors such as /tmp, where others cannot rename what root owns."""
    real = os.path.realpath(path)
    os.makedirs(real, mode=0o700, exist_ok=True)
    at = real
    while True:
        st = os.stat(at)
        shared = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if st.st_uid != 0 or (shared and (at == real or not st.st_mode & stat.S_ISVTX)):
            raise InvalidArgument(
                f"{field}={path!r}: {at!r} (owner uid {st.st_uid}, mode {oct(stat.S_IMODE(st.st_mode))}) can be changed by "
                "someone other than root, who could then replace the programs and base image the daemon uses; pick a directory "
                "that only root can write"
            )
        if at == "/":
            return
        at = os.path.dirname(at)


def build(cache_dir: str) -> str:
    """Path of the compiled helper for this host, compiled on first use; Unsupported with the compiler's words if it fails."""
    cc = compiler()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False, env=HOST_ENV).stdout
    key = hashlib.sha256(f"{C_SOURCE}\0{cc}\0{version}".encode()).hexdigest()[:16]
    final = os.path.join(cache_dir, f"openk3-enter-{key}")
    if os.path.isfile(final) and os.stat(final).st_uid == 0 and os.access(final, os.X_OK):
        return final
    os.makedirs(cache_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".openk3-enter-", dir=cache_dir)
    os.close(fd)
    try:
        # No -Werror here: a new compiler's new warning must not stop the daemon (tests build it with -Werror instead).
        cmd = [cc, *COMPILE_FLAGS, "-o", tmp, "-x", "c", "-"]
        done = subprocess.run(cmd, input=C_SOURCE, capture_output=True, text=True, check=False, env=HOST_ENV)
        if done.returncode != 0:
            raise Unsupported(f"building openk3-enter with {cc} failed (a static libc is needed: apt-get install libc6-dev): {done.stderr.strip()[-1500:]}")
        os.chmod(tmp, 0o700)  # only the daemon (root) runs it
        os.rename(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("built %s", final)
    return final


def environment(env: dict[str, str], field: str) -> list[str]:
    """`KEY=value` strings for the helper; a key with '=' or NUL, or a value with NUL, names the field and is refused."""
    out = []
    for key, value in env.items():
        if not isinstance(key, str) or not isinstance(value, str) or not key or "=" in key or "\0" in key or "\0" in value:
            raise InvalidArgument(f"{field}[{key!r}]: expected a non-empty variable name without '=' or NUL and a value without NUL")
        out.append(f"{key}={value}")
    return out


@dataclasses.dataclass(frozen=True)
class Helper:
    path: str  # the compiled openk3-enter
    seccomp_hex: str  # the seccomp program every command loads (seccomp.py), as the helper reads it

    def spawn_argv(self, procs_files: list[str], uid: int | None, argv: list[str]) -> list[str]:
        """Join the cgroups, drop to host `uid` (None: stay root), exec `argv` (argv[0] an absolute host path)."""
        return [self.path, "spawn", "-" if uid is None else str(uid), str(len(procs_files)), *procs_files, *argv]

    def enter_argv(self, pidfd: int, init_pid: int, spec_fd: int, procs_files: list[str], tty: bool = False) -> list[str]:
        """Join the cgroups and the sandbox of `init_pid` (whose pidfd the daemon holds), drop everything, exec the command of
        `spec_fd` (a `command_spec` memfd); with `tty`, its stdin (a pty slave) becomes its controlling terminal."""
        mode = "enter-tty" if tty else "enter"
        return [self.path, mode, str(pidfd), str(init_pid), self.seccomp_hex, str(spec_fd), str(len(procs_files)), *procs_files]


def command_spec(cwd: str, env: list[str], argv: list[str]) -> int:
    """A memfd holding what openk3-enter runs (NUL-terminated: cwd, the variable count, the variables, the argv), at offset 0;
    the caller passes it to the helper and closes it. A memfd rather than a pipe: any size, and nothing blocks on a reader."""
    fd = os.memfd_create("openk3-enter-command", os.MFD_CLOEXEC)
    try:
        data = b"".join(part.encode() + b"\0" for part in (cwd, str(len(env)), *env, *argv))
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        raise
    return fd


def command_argv(cmd: str | list[str]) -> list[str]:
    """The command as the helper execs it inside the sandbox: a shell string under the sandbox's /bin/sh, an argv list as is."""
    return ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)

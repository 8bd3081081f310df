"""The base rootfs: a minimal tree built offline from the host's own binaries and their shared libraries, cached.

Why a copied tree rather than read-only binds of the host's /usr: the base is the bottom overlay layer, so a sandbox can
delete or replace any file in it (and snapshots capture that) while the host copy stays untouched; and the sandbox never sees the
rest of the host's /usr (compilers, credentials in /usr/local, ...). It is about 60 tools plus the libraries `ldd` names and,
when the host has one, its system python3 with the standard library (~40 MB, 700 files), built in a second or two and cached
under a key made of each binary's path, size and mtime, so a host upgrade rebuilds it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile

from openk3.sandbox.linux.helper import HOST_ENV, host_binary

FORMAT = "openk3-rootfs-1"
REQUIRED = ("sh", "bash", "sleep", "cat", "tar")
TOOLS = REQUIRED + (
    "env",
    "setpriv",
    "ls",
    "cp",
    "mv",
    "rm",
    "mkdir",
    "rmdir",
    "touch",
    "ln",
    "chmod",
    "chown",
    "stat",
    "head",
    "tail",
    "wc",
    "sort",
    "uniq",
    "cut",
    "tr",
    "echo",
    "printf",
    "test",
    "true",
    "false",
    "id",
    "whoami",
    "date",
    "seq",
    "yes",
    "dd",
    "df",
    "du",
    "sha256sum",
    "md5sum",
    "basename",
    "dirname",
    "readlink",
    "realpath",
    "mktemp",
    "nohup",
    "timeout",
    "setsid",
    "kill",
    "ps",
    "mknod",
    "tee",
    "xargs",
    "find",
    "grep",
    "sed",
    "awk",
    "gzip",
    "hostname",
    "sync",
    "cmp",
    "diff",
    "expr",
    "nproc",
    "uname",
    "pwd",
    "mkfifo",
    "tty",  # terminal sessions (pty_create): what a user of a terminal expects to find
    "stty",
)
ETC = {
    "etc/passwd": "root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
    "etc/group": "root:x:0:\nnogroup:x:65534:\n",
    "etc/hostname": "sandbox\n",
    "etc/hosts": "127.0.0.1 localhost sandbox\n",
}
# The host's system Python (not a virtualenv's): its binary, its standard library minus tests and GUI toolkits, and the
# shared libraries of its extension modules, so coding tasks can run `python3` without shipping an interpreter in a layer.
PYTHON_SKIP = ("test", "idlelib", "tkinter", "turtledemo", "site-packages", "dist-packages", "__pycache__", "ensurepip")
DIRS = ("usr/bin", "usr/lib", "usr/lib64", "etc", "root", "home", "tmp", "var/tmp", "work", "proc", "dev", "run")
MERGED_USR = {"bin": "usr/bin", "sbin": "usr/bin", "lib": "usr/lib", "lib64": "usr/lib64"}


def _resolve_tools() -> list[tuple[str, str]]:
    found = []
    for name in TOOLS:
        path = shutil.which(name, path="/usr/bin:/bin:/usr/sbin:/sbin")
        if path is None:
            if name in REQUIRED:
                raise FileNotFoundError(f"base rootfs: host tool {name!r} not found; install it (e.g. util-linux, coreutils, tar)")
            continue
        found.append((name, os.path.realpath(path)))
    return found


def _libraries(binaries: list[str]) -> set[str]:
    # ldd by its absolute system path with the fixed host environment: the daemon's PATH or LD_* variables must not choose
    # what runs as root here or which libraries end up in every sandbox.
    ldd = host_binary("ldd")
    if ldd is None:
        raise FileNotFoundError("base rootfs: host tool 'ldd' not found in the system directories; install libc-bin")
    out = subprocess.run([ldd, *binaries], capture_output=True, text=True, check=False, env=HOST_ENV).stdout
    libs = set()
    for line in out.splitlines():
        for word in line.split():
            if word.startswith("/") and os.path.exists(word):
                libs.add(word)
    return libs


def _in_tree(path: str) -> str:
    """Where a host path lands in the merged-/usr tree: /lib/x/libc.so.6 -> usr/lib/x/libc.so.6."""
    rel = path.lstrip("/")
    top, _, rest = rel.partition("/")
    return f"{MERGED_USR[top]}/{rest}" if top in MERGED_USR else rel


def _python() -> tuple[str, str] | None:
    """(interpreter, stdlib dir) of the host's system python3, if it has the usual /usr/lib/pythonX.Y layout."""
    exe = shutil.which("python3", path="/usr/bin:/bin")
    if exe is None:
        return None
    exe = os.path.realpath(exe)
    stdlib = os.path.join("/usr/lib", os.path.basename(exe))
    return (exe, stdlib) if os.path.isfile(os.path.join(stdlib, "os.py")) else None


def _copy_python(dst: str, exe: str, stdlib: str) -> list[str]:
    """Copy the interpreter and its stdlib; returns the binaries whose libraries must come along."""
    shutil.copy2(exe, os.path.join(dst, "usr/bin", os.path.basename(exe)))
    os.symlink(os.path.basename(exe), os.path.join(dst, "usr/bin/python3"))
    shutil.copytree(stdlib, os.path.join(dst, _in_tree(stdlib)), symlinks=True, ignore=lambda _d, names: [n for n in names if n in PYTHON_SKIP])
    dynload = os.path.join(stdlib, "lib-dynload")
    return [exe, *(os.path.join(dynload, n) for n in os.listdir(dynload) if n.endswith(".so"))] if os.path.isdir(dynload) else [exe]


def cache_key(tools: list[tuple[str, str]], owner: int) -> str:
    h = hashlib.sha256(f"{FORMAT}\0owner={owner}".encode())
    python = _python()
    if python is not None:
        tools = [*tools, ("python", python[0])]
    for name, path in tools:
        st = os.stat(path)
        h.update(f"{name}\0{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def build(dst: str) -> None:
    tools = _resolve_tools()
    for d in DIRS:
        os.makedirs(os.path.join(dst, d), exist_ok=True)
    os.chmod(os.path.join(dst, "tmp"), 0o1777)
    os.chmod(os.path.join(dst, "var/tmp"), 0o1777)
    os.chmod(os.path.join(dst, "root"), 0o700)
    for link, target in MERGED_USR.items():
        os.symlink(target, os.path.join(dst, link))
    binaries = [p for _, p in tools]
    for name, path in tools:
        shutil.copy2(path, os.path.join(dst, "usr/bin", name))
    python = _python()
    if python is not None:
        binaries += _copy_python(dst, *python)
    for lib in _libraries(binaries):
        target = os.path.join(dst, _in_tree(lib))
        if not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(os.path.realpath(lib), target)
    for rel, text in ETC.items():
        with open(os.path.join(dst, rel), "w") as f:
            f.write(text)


def chown_tree(root: str, owner: int) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(dirpath, name), owner, owner)
    os.lchown(root, owner, owner)


def ensure_base(cache_dir: str, owner: int = 0) -> str:
    """Path of the cached base rootfs for this host, owned by host uid `owner` (the sandbox's root), built when missing."""
    tools = _resolve_tools()
    final = os.path.join(cache_dir, f"rootfs-{cache_key(tools, owner)}")
    if os.path.isdir(final):
        return final
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".rootfs-", dir=cache_dir)
    try:
        build(tmp)
        os.chmod(tmp, 0o755)
        chown_tree(tmp, owner)
        os.rename(tmp, final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isdir(final):
            raise
    return final


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "openk3", "sandbox")

"""The seccomp deny-list (linux/seccomp.py): run by a small classic-BPF interpreter for both arches, checked against the kernel
headers where they are installed, and loaded into a real process (no namespaces or root needed)."""

from __future__ import annotations

import errno
import os
import re
import struct
import subprocess
import sys

import pytest

from openk3.sandbox.linux import seccomp

OPS = {seccomp.LD_W_ABS, seccomp.JEQ_K, seccomp.JGE_K, seccomp.JSET_K, seccomp.RET_K}


def run_filter(prog: bytes, nr: int, arch: int, arg0: int = 0) -> int:
    """The value the kernel's BPF would return for one syscall (only the opcodes the program may use)."""
    data = struct.pack("<IIQ6Q", nr, arch, 0, arg0 & (2**64 - 1), 0, 0, 0, 0, 0)
    ins = [seccomp.INSTRUCTION.unpack_from(prog, i) for i in range(0, len(prog), seccomp.INSTRUCTION.size)]
    acc, pc = 0, 0
    while True:
        code, jt, jf, k = ins[pc]
        assert code in OPS, f"unexpected opcode {code:#x} at {pc}"
        pc += 1
        if code == seccomp.LD_W_ABS:
            (acc,) = struct.unpack_from("<I", data, k)
        elif code == seccomp.RET_K:
            return k
        else:
            taken = acc == k if code == seccomp.JEQ_K else acc >= k if code == seccomp.JGE_K else bool(acc & k)
            pc += jt if taken else jf
        assert pc < len(ins), "fell off the end of the program"


EPERM = seccomp.RET_ERRNO | errno.EPERM
ENOSYS = seccomp.RET_ERRNO | errno.ENOSYS


@pytest.mark.parametrize("arch", [seccomp.X86_64, seccomp.AARCH64], ids=lambda a: a.name)
def test_program_denies_the_list_and_allows_the_rest(arch):
    prog = seccomp.program(arch)
    for name in seccomp.DENIED:
        if name in arch.numbers:
            assert run_filter(prog, arch.numbers[name], arch.audit_arch) == EPERM, name
    checked = (*seccomp.DENIED, *seccomp.FLAG_CHECKED, *seccomp.ARG_CHECKED, *seccomp.NOT_IMPLEMENTED)
    denied = {arch.numbers[n] for n in checked if n in arch.numbers}
    for nr in set(range(480)) - denied:
        assert run_filter(prog, nr, arch.audit_arch) == seccomp.RET_ALLOW, nr
    assert run_filter(prog, arch.numbers["clone3"], arch.audit_arch) == ENOSYS
    for name in seccomp.FLAG_CHECKED:
        nr = arch.numbers[name]
        assert run_filter(prog, nr, arch.audit_arch, 0x01200011) == seccomp.RET_ALLOW  # fork()'s clone flags
        assert run_filter(prog, nr, arch.audit_arch, 0x00000400) == seccomp.RET_ALLOW  # unshare(CLONE_FILES)
        for flag in (0x10000000, 0x00020000, 0x20000000, 0x40000000, 0x02000000, 0x00000080):  # USER NS PID NET CGROUP TIME
            assert run_filter(prog, nr, arch.audit_arch, flag | 0x11) == EPERM, (name, hex(flag))
    # Docker's additions: calls that reach into another process, the newest mount call, quotas by fd.
    for name in ("pidfd_getfd", "kcmp", "process_madvise", "process_mrelease", "open_tree_attr", "quotactl_fd"):
        assert run_filter(prog, arch.numbers[name], arch.audit_arch) == EPERM, name
    persona = arch.numbers["personality"]
    for value in (0, 8, 0x20000, 0x20008, 0xFFFFFFFF):
        assert run_filter(prog, persona, arch.audit_arch, value) == seccomp.RET_ALLOW, hex(value)
    for value in (0x0040000, 0x0400000, 0x0200000, 0x1, 0x100000000, 0xFFFFFFFF_FFFFFFFF, -1):
        assert run_filter(prog, persona, arch.audit_arch, value) == EPERM, hex(value)  # ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC, ...
    # Another ABI's numbers must not slip past the table: i386 on x86_64 (and anything unknown) kills.
    assert run_filter(prog, 1, 0x40000003) == seccomp.RET_KILL_PROCESS
    other = seccomp.AARCH64 if arch is seccomp.X86_64 else seccomp.X86_64
    assert run_filter(prog, 1, other.audit_arch) == seccomp.RET_KILL_PROCESS
    if arch.x32_bit:
        assert run_filter(prog, 0x40000000 | 165, arch.audit_arch) == seccomp.RET_KILL_PROCESS  # x32 mount


@pytest.mark.parametrize(
    ("arch", "header", "pattern"),
    [
        (seccomp.X86_64, "/usr/include/x86_64-linux-gnu/asm/unistd_64.h", r"#define __NR_(\w+)\s+(\d+)"),
        (seccomp.AARCH64, "/usr/include/asm-generic/unistd.h", r"#define __NR(?:3264)?_(\w+)\s+(\d+)"),
    ],
    ids=["x86_64", "aarch64"],
)
def test_syscall_numbers_match_the_kernel_headers(arch, header, pattern):
    if not os.path.exists(header):
        pytest.skip(f"{header} not installed (linux-libc-dev)")
    with open(header) as f:
        known = {name: int(nr) for name, nr in re.findall(pattern, f.read())}
    for name, nr in arch.numbers.items():
        if name in known:
            assert known[name] == nr, name
        else:  # a call newer than the installed headers (open_tree_attr is 6.15): numbered after everything they know
            assert nr > max(known.values()), name


PROBE = r"""
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
prog = bytes.fromhex(sys.argv[1])
buf = ctypes.create_string_buffer(prog, len(prog))
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
fprog = Fprog(len(prog) // 8, ctypes.addressof(buf))
assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0, ctypes.get_errno()  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
def call(name, *args):
    nr = int(sys.argv[2 + ["unshare", "mount", "keyctl", "bpf", "clone3", "getpid"].index(name)])
    rc = libc.syscall(nr, *args)
    return "ok" if rc >= 0 else errno.errorcode[ctypes.get_errno()]
print(call("unshare", 0x10000000), call("mount", None, None, None, 0, None), call("keyctl", 0, 0, 0, 0, 0),
      call("bpf", 0, None, 0), call("clone3", None, 0), call("getpid"))
pid = os.fork()
if pid == 0:
    os._exit(7)
print(os.waitpid(pid, 0)[1] >> 8)
"""


def test_kernel_applies_the_program():
    arch = seccomp.host_arch()
    nrs = [str(arch.numbers[n]) for n in ("unshare", "mount", "keyctl", "bpf", "clone3")] + [str({"x86_64": 39, "aarch64": 172}[arch.name])]
    out = subprocess.run([sys.executable, "-c", PROBE, seccomp.program().hex(), *nrs], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["EPERM", "EPERM", "EPERM", "EPERM", "ENOSYS", "ok", "7"]

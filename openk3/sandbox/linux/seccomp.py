"""The seccomp deny-list every sandbox process runs under, as a classic BPF program written out by hand.

Why these calls: a sandbox has no capabilities, so many of them fail anyway; the filter removes the kernel code behind them
from reach (the usual container escapes and kernel bugs: nested user namespaces, the mount API, ptrace and the other calls
that reach into another process (process_vm_*, pidfd_getfd, kcmp, process_madvise, process_mrelease), keyrings, bpf,
perf_event_open, userfaultfd, io_uring, file handles, quotas, module and kexec loading); the list covers what Docker's
default profile denies to a container without capabilities. Denied calls return EPERM; `clone` and `unshare` are denied only
with a CLONE_NEW* flag, `personality` for any persona but the few Docker allows (Linux, and the query 0xffffffff; others
switch on odd kernel paths such as READ_IMPLIES_EXEC or ADDR_NO_RANDOMIZE), and `clone3` returns ENOSYS because its flags
sit behind a pointer the filter cannot read (libc then falls back to `clone`). A call made through another ABI than the
filter's (i386 `int 0x80` or x32 on x86_64) kills the process, so the syscall numbers below cannot be bypassed.

The same bytes go to bwrap (`--seccomp FD`, for the init and its descendants) and to openk3-enter (for each command, which
joins from outside and so does not inherit the init's filter).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import struct

# struct sock_filter {u16 code; u8 jt; u8 jf; u32 k;} in native byte order, as the kernel reads it
INSTRUCTION = struct.Struct("=HBBI")
LD_W_ABS = 0x20
JEQ_K = 0x15
JGE_K = 0x35
JSET_K = 0x45
RET_K = 0x06

RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_ALLOW = 0x7FFF0000

# struct seccomp_data: nr (u32), arch (u32), instruction_pointer (u64), args[6] (u64); both arches here are little-endian,
# so the low half of args[0] (clone's and unshare's flags) is at offset 16.
NR_OFFSET = 0
ARCH_OFFSET = 4
ARG0_LOW_OFFSET = 16
ARG0_HIGH_OFFSET = 20

CLONE_NEW_FLAGS = 0x00020000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x02000000 | 0x00000080  # NS UTS IPC USER PID NET CGROUP TIME
X32_SYSCALL_BIT = 0x40000000
# PER_LINUX, PER_LINUX32, UNAME26, PER_LINUX32|UNAME26 and the query: the personality values Docker's profile allows
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

DENIED = (
    "mount",
    "umount2",
    "pivot_root",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "open_tree_attr",
    "chroot",
    "setns",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    "kcmp",
    "process_madvise",
    "process_mrelease",
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "name_to_handle_at",
    "open_by_handle_at",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "swapon",
    "swapoff",
    "reboot",
    "acct",
    "quotactl",
    "quotactl_fd",
    "lookup_dcookie",
    "iopl",
    "ioperm",
)
FLAG_CHECKED = ("clone", "unshare")
ARG_CHECKED = ("personality",)
NOT_IMPLEMENTED = ("clone3",)


@dataclasses.dataclass(frozen=True)
class Arch:
    name: str
    audit_arch: int  # AUDIT_ARCH_* of the ABI the filter accepts
    x32_bit: bool  # whether syscall numbers with __X32_SYSCALL_BIT reach this ABI's entry (x86_64 only)
    numbers: dict[str, int]


X86_64 = Arch(
    "x86_64",
    0xC000003E,
    True,
    {
        "mount": 165, "umount2": 166, "pivot_root": 155, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "chroot": 161, "setns": 308, "ptrace": 101, "process_vm_readv": 310,
        "process_vm_writev": 311, "keyctl": 250, "add_key": 248, "request_key": 249, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "name_to_handle_at": 303,
        "open_by_handle_at": 304, "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "swapon": 167, "swapoff": 168, "reboot": 169, "acct": 163, "quotactl": 179, "lookup_dcookie": 212,
        "iopl": 172, "ioperm": 173, "clone": 56, "unshare": 272, "clone3": 435, "pidfd_getfd": 438, "kcmp": 312,
        "process_madvise": 440, "process_mrelease": 448, "open_tree_attr": 467, "quotactl_fd": 443, "personality": 135,
    },
)  # fmt: skip
AARCH64 = Arch(
    "aarch64",
    0xC00000B7,
    False,
    {
        "mount": 40, "umount2": 39, "pivot_root": 41, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
        "fsmount": 432, "fspick": 433, "mount_setattr": 442, "chroot": 51, "setns": 268, "ptrace": 117, "process_vm_readv": 270,
        "process_vm_writev": 271, "keyctl": 219, "add_key": 217, "request_key": 218, "bpf": 280, "perf_event_open": 241,
        "userfaultfd": 282, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427, "name_to_handle_at": 264,
        "open_by_handle_at": 265, "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "swapon": 224, "swapoff": 225, "reboot": 142, "acct": 89, "quotactl": 60, "lookup_dcookie": 18,
        "clone": 220, "unshare": 97, "clone3": 435, "pidfd_getfd": 438, "kcmp": 272, "process_madvise": 440,
        "process_mrelease": 448, "open_tree_attr": 467, "quotactl_fd": 443, "personality": 92,
    },
)  # fmt: skip
ARCHES = {"x86_64": X86_64, "aarch64": AARCH64}


def host_arch() -> Arch:
    machine = os.uname().machine
    if machine not in ARCHES:
        raise OSError(f"no seccomp syscall table for machine {machine!r} (known: {sorted(ARCHES)})")
    return ARCHES[machine]


def instructions(arch: Arch) -> list[tuple[int, int, int, int]]:
    """(code, jt, jf, k) tuples; jumps are written against labels and resolved to the relative offsets BPF uses."""
    prog: list[tuple[int, int | str, int | str, int]] = [(LD_W_ABS, 0, 0, ARCH_OFFSET), (JEQ_K, 0, "kill", arch.audit_arch), (LD_W_ABS, 0, 0, NR_OFFSET)]
    if arch.x32_bit:
        prog.append((JGE_K, "kill", 0, X32_SYSCALL_BIT))
    prog += [(JEQ_K, "eperm", 0, arch.numbers[name]) for name in DENIED if name in arch.numbers]
    prog += [(JEQ_K, "flags", 0, arch.numbers[name]) for name in FLAG_CHECKED]
    prog += [(JEQ_K, "persona", 0, arch.numbers[name]) for name in ARG_CHECKED]
    prog += [(JEQ_K, "enosys", 0, arch.numbers[name]) for name in NOT_IMPLEMENTED]
    prog.append((RET_K, 0, 0, RET_ALLOW))
    labels = {"flags": len(prog)}
    prog += [(LD_W_ABS, 0, 0, ARG0_LOW_OFFSET), (JSET_K, "eperm", 0, CLONE_NEW_FLAGS), (RET_K, 0, 0, RET_ALLOW)]
    # personality's argument is an unsigned long: the high half must be 0 and the low half one of the allowed values.
    labels["persona"] = len(prog)
    prog += [(LD_W_ABS, 0, 0, ARG0_HIGH_OFFSET), (JEQ_K, 0, "eperm", 0), (LD_W_ABS, 0, 0, ARG0_LOW_OFFSET)]
    prog += [(JEQ_K, "allow", 0, value) for value in PERSONALITIES[:-1]]
    prog.append((JEQ_K, 0, "eperm", PERSONALITIES[-1]))
    labels["allow"] = len(prog)
    prog.append((RET_K, 0, 0, RET_ALLOW))
    labels["eperm"] = len(prog)
    prog.append((RET_K, 0, 0, RET_ERRNO | errno.EPERM))
    labels["enosys"] = len(prog)
    prog.append((RET_K, 0, 0, RET_ERRNO | errno.ENOSYS))
    labels["kill"] = len(prog)
    prog.append((RET_K, 0, 0, RET_KILL_PROCESS))

    def offset(at: int, target: int | str) -> int:
        if isinstance(target, int):
            return target
        jump = labels[target] - at - 1
        assert 0 <= jump <= 255, f"jump to {target} out of range ({jump})"
        return jump

    return [(code, offset(i, jt), offset(i, jf), k) for i, (code, jt, jf, k) in enumerate(prog)]


def program(arch: Arch | None = None) -> bytes:
    """The filter as bytes of struct sock_filter, for bwrap's --seccomp FD and (hex-encoded) openk3-enter."""
    return b"".join(INSTRUCTION.pack(*ins) for ins in instructions(arch or host_arch()))

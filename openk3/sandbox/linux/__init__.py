"""Linux primitives: syscalls.py (mount, umount, openat2), cgroups.py (v1/v2 limits, freeze, kill), helper.py and
helper_source.py (openk3-enter: joining a sandbox and dropping privileges), seccomp.py (the syscall filter), proc.py (running
a command and capturing its output), host.py (what this host supports)."""

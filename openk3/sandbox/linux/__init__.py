"""Linux primitives: syscalls.py (mount, umount, openat2), cgroups.py (v1/v2 limits, freeze, kill), proc.py (entering a
sandbox's namespaces and capturing output), host.py (what this host supports)."""

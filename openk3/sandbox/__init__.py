"""AgentEnv-style RL sandboxes: namespaces + overlay + cgroups, fs and process snapshots (docs/sandbox.md); a leaf: no torch,
no other openk3 package.

Sub-packages by role; the arrows are the only imports between them (each also uses `protocol.py`, the shared types and errors):

    api/        service.py (the whole API of one host), server.py (HTTP), client.py   -> namespace/, process/, fs/
    namespace/  namespace sandboxes: lifecycle.py + backend.py (NamespaceBackend), instance.py, bwrap.py (the init's
                command line), startup.py (waiting for an init, bounded), standby.py, shell.py, settings.py
                (BackendConfig)                                                           -> fs/, linux/
    process/    Python-native environments with process snapshots: envs.py, registry.py (the operator's allow-list of
                factories), forkserver.py, wire.py, demo_env.py                           -> linux/
    fs/         file trees and layers: tree.py, layers.py (the layer store), rootfs.py, safefs.py, naive.py  -> linux/
    linux/      host primitives: syscalls.py, cgroups.py, helper.py + helper_source.py (openk3-enter, the one host program
                that enters a sandbox), seccomp.py (the filter), proc.py (running a command), host.py (what the host supports)

`cli.py` is `openk3 sandbox serve`, here beside the sub-packages because openk3/cli.py loads every package's own `cli.py`.
"""

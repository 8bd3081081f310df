"""AgentEnv-style RL sandboxes: namespaces + overlay + cgroups, fs and process snapshots (docs/sandbox.md); a leaf: no torch,
no other openk3 package.

Sub-packages by role; the arrows are the only imports between them (each also uses `protocol.py`, the shared types and errors):

    api/        service.py (the whole API of one host), server.py (HTTP), client.py   -> namespace/, process/, fs/
    namespace/  namespace sandboxes: lifecycle.py + backend.py (NamespaceBackend), instance.py, standby.py, shell.py,
                settings.py (BackendConfig)                                              -> fs/, linux/
    process/    Python-native environments with process snapshots: envs.py, forkserver.py, wire.py, demo_env.py -> linux/
    fs/         file trees and layers: tree.py, layers.py (the layer store), rootfs.py, safefs.py, naive.py  -> linux/
    linux/      host primitives: syscalls.py, cgroups.py, proc.py (entering a sandbox), host.py (what the host supports)

`cli.py` is `openk3 sandbox serve`, here beside the sub-packages because openk3/cli.py loads every package's own `cli.py`.
"""

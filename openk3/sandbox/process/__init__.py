"""Python-native environments ("pe-" ids) with process snapshots ("psnap-"): ProcessEnvs (envs.py) on the host drives fork
servers (forkserver.py) over wire.py, starting only the factories the operator registered (registry.py); demo_env.py is a
small environment for tests and benchmarks."""

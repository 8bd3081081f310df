"""Joining a Ray cluster, or starting a local one, with errors that say which.

`ray.init` runs in the caller's (main) thread: started from another thread, Ray cannot install its signal handlers and
its driver fails to reach the GCS it just started. Its wait for the GCS is Ray's own bound (60 s), after which Ray ends
the process with its message; an error Ray raises instead becomes a RayStartError naming the cluster. A local cluster is
started with the dashboard off (not needed, and the slowest part to start).
"""

from __future__ import annotations

import ray


class RayStartError(RuntimeError):
    pass


def connect(address: str | None, num_cpus: int | None = None) -> None:
    if ray.is_initialized():
        return
    where = "a local Ray cluster" if address is None else f"the Ray cluster at {address}"
    try:
        if address is None:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    except Exception as e:
        raise RayStartError(f"{where} could not be started: {e}") from e

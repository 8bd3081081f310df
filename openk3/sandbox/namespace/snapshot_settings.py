"""The settings a sandbox had when an fs snapshot was taken of it, kept with the snapshot (in its manifest).

A snapshot holds files; a sandbox is files plus how it runs: its limits, environment, working directory, TTL, services and
labels. `fork(sandbox_id)` copies those from the live sandbox; `fork(snapshot_id)` reads them from here, so the two forks of
the same state are the same sandbox (without this, a fork of a snapshot came back with default limits, no services and no
labels). Imported snapshots and manifests written before this existed have no settings: their forks take the defaults, as
`create(image=...)` does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from openk3.sandbox.protocol import Limits, check_labels, from_jsonable, to_jsonable


@dataclasses.dataclass(frozen=True)
class SandboxSettings:
    limits: Limits
    env: dict[str, str]
    workdir: str
    ttl_s: float
    services: tuple[str, ...]
    labels: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {
            "limits": to_jsonable(self.limits),
            "env": dict(self.env),
            "workdir": self.workdir,
            "ttl_s": self.ttl_s,
            "services": list(self.services),
            "labels": dict(self.labels),
        }

    @classmethod
    def from_json(cls, doc: Any) -> SandboxSettings:
        """Parsed and checked as a caller's create() arguments would be; ValueError (or TypeError, KeyError) when malformed."""
        if not isinstance(doc, dict):
            raise ValueError("settings: expected an object")
        env, labels, services = doc["env"], doc["labels"], doc["services"]
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError("settings.env: expected an object of strings")
        if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
            raise ValueError("settings.labels: expected an object of strings")
        if not isinstance(services, list) or not all(isinstance(s, str) for s in services):
            raise ValueError("settings.services: expected a list of strings")
        if not isinstance(doc["workdir"], str) or not isinstance(doc["ttl_s"], (int, float)) or not isinstance(doc["limits"], dict):
            raise ValueError("settings: workdir must be a string, ttl_s a number, limits an object")
        return cls(
            limits=from_jsonable(Limits, doc["limits"]),
            env=env,
            workdir=doc["workdir"],
            ttl_s=float(doc["ttl_s"]),
            services=tuple(services),
            labels=check_labels(labels, "settings.labels"),
        )

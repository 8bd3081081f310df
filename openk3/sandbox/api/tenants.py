"""Tenants: who is calling, from the API key, and what each may hold (the keys file the operator writes).

The keys file is JSON, readable by its owner only (a key others can read is a key others have):

    {"tenants": [
      {"name": "ops",    "key": "<at least 16 characters>", "operator": true},
      {"name": "team-a", "key": "...", "max_sandboxes": 32, "max_store_bytes": 4294967296}
    ]}

`name` is 1-63 of `a-z0-9_-`; keys are distinct and at least MIN_KEY_CHARS long; `max_sandboxes` bounds the tenant's live
sandboxes and Python environments together, `max_store_bytes` the layer-store bytes its fs snapshots added (either absent: no
limit beyond the host's); `operator` may read the daemon-wide `GET /metrics`. A request's key is compared with every
tenant's key in constant time and all of them are compared, so the time taken says neither which tenant nor how much of a
guess was right.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import os
import re
import stat
from typing import Any

from openk3.sandbox.api.auth import MIN_KEY_CHARS
from openk3.sandbox.protocol import InvalidArgument

NAME = re.compile(r"[a-z0-9_-]{1,63}")
FIELDS = frozenset({"name", "key", "max_sandboxes", "max_store_bytes", "operator"})


@dataclasses.dataclass(frozen=True)
class Tenant:
    name: str
    key: str = dataclasses.field(repr=False)
    max_sandboxes: int | None = None
    max_store_bytes: int | None = None
    operator: bool = False

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name):
            raise InvalidArgument(f"tenant name={self.name!r}: expected 1-63 characters of a-z 0-9 _ -")
        if len(self.key) < MIN_KEY_CHARS:
            raise InvalidArgument(f"tenant {self.name}: its key has {len(self.key)} characters; use at least {MIN_KEY_CHARS}")
        for field in ("max_sandboxes", "max_store_bytes"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise InvalidArgument(f"tenant {self.name}: {field}={value!r}: expected an integer >= 0 or absent")


class Tenants:
    def __init__(self, tenants: list[Tenant]) -> None:
        if not tenants:
            raise InvalidArgument("keys file: expected at least one tenant")
        names = [t.name for t in tenants]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"keys file: tenant names must be distinct, got {names}")
        if len({t.key for t in tenants}) != len(tenants):
            raise InvalidArgument("keys file: two tenants share a key; each tenant needs its own")
        self.by_name = {t.name: t for t in tenants}

    def identify(self, token: str | None) -> Tenant | None:
        """The tenant whose key is `token`, or None; every key is compared, each in constant time."""
        given = (token or "").encode("utf-8", "surrogateescape")
        found = None
        for tenant in self.by_name.values():
            if hmac.compare_digest(given, tenant.key.encode()):
                found = tenant
        return found if token is not None else None


def _tenant(entry: Any) -> Tenant:
    if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not isinstance(entry.get("key"), str):
        raise InvalidArgument('keys file: each tenant is an object with a string "name" and "key"')
    unknown = set(entry) - FIELDS
    if unknown:
        raise InvalidArgument(f"keys file: tenant {entry['name']!r} has unknown fields {sorted(unknown)}; expected {sorted(FIELDS)}")
    if not isinstance(entry.get("operator", False), bool):
        raise InvalidArgument(f"keys file: tenant {entry['name']!r}: operator must be true or false")
    return Tenant(**entry)


def parse(text: str) -> Tenants:
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise InvalidArgument(f"keys file: not JSON ({e})") from e
    if not isinstance(doc, dict) or set(doc) != {"tenants"} or not isinstance(doc["tenants"], list):
        raise InvalidArgument('keys file: expected {"tenants": [{"name": ..., "key": ...}, ...]}')
    return Tenants([_tenant(entry) for entry in doc["tenants"]])


def load(path: str) -> Tenants:
    """The keys file at `path`; refused when group or others may read or write it."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if stat.S_IMODE(mode) & 0o077:
            raise InvalidArgument(f"keys file {path}: mode {stat.S_IMODE(mode):o} lets others read or change the keys; chmod 600 it")
        return parse(f.read().decode("utf-8"))

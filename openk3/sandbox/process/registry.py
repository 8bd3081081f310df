"""The environment factories a host daemon may start: an allow-list fixed by its operator at start-up.

Why an allow-list: a Python environment runs as host root outside any namespace sandbox (process/envs.py), so whoever picks
its `module:callable` and import path picks code the host runs as root. Callers name a registered factory ("demo", or what
the operator added with `openk3 sandbox serve --env-factory name=module:callable`); nothing else is imported, and a caller
cannot extend the import path.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

from openk3.sandbox.protocol import InvalidArgument

BUILTIN = {"demo": "openk3.sandbox.process.demo_env:RandomWalkEnv"}
NAME = re.compile(r"[a-z][a-z0-9_.-]{0,63}")
SPEC = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class EnvFactories:
    factories: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(BUILTIN))  # name -> "package.module:callable"
    pythonpath: tuple[str, ...] = ()  # extra import directories for the operator's factories

    def __post_init__(self) -> None:
        for name, spec in self.factories.items():
            if not NAME.fullmatch(name):
                raise InvalidArgument(f"env factory name {name!r}: expected lowercase letters, digits, '_', '.' or '-' (at most 64)")
            if not SPEC.fullmatch(spec):
                raise InvalidArgument(f"env factory {name}={spec!r}: expected 'package.module:callable'")
        for path in self.pythonpath:
            if not path.startswith("/"):
                raise InvalidArgument(f"env pythonpath {path!r}: expected an absolute directory")

    @classmethod
    def parse(cls, entries: list[str], pythonpath: list[str]) -> EnvFactories:
        """The built-in factories plus `name=module:callable` entries (the operator's command line)."""
        factories = dict(BUILTIN)
        for entry in entries:
            name, sep, spec = entry.partition("=")
            if not sep:
                raise InvalidArgument(f"--env-factory {entry!r}: expected name=package.module:callable")
            factories[name] = spec
        return cls(factories, tuple(pythonpath))

    def resolve(self, name: str) -> str:
        if name not in self.factories:
            raise InvalidArgument(
                f"factory={name!r}: not a registered environment factory (registered: {sorted(self.factories)}); "
                "the host's operator registers factories with `openk3 sandbox serve --env-factory name=module:callable`"
            )
        return self.factories[name]

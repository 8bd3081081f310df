"""A sandbox service for the episode tests, from the sandbox suite's own host probe and settings (skipped, with the probe's
reason, where namespaces are unavailable)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from openk3.sandbox.api.service import SandboxService
from openk3.sandbox.linux.host import probe
from openk3.sandbox.namespace.settings import BackendConfig
from tests.sandbox.conftest import sandbox_uid, started, state_dir


@pytest.fixture(scope="session")
def sandboxes(tmp_path_factory) -> Iterator[SandboxService]:
    features = probe()
    if features.unavailable_reason:
        pytest.skip(f"namespace sandboxes unavailable: {features.unavailable_reason}")
    cache = str(tmp_path_factory.mktemp("rl-sandbox-cache"))
    yield from started(BackendConfig(state_dir=state_dir(), cache_dir=cache, store_bytes=512 * 2**20, sandbox_uid=sandbox_uid()))

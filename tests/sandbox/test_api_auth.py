"""The API token: required on every request when set, 401 with a JSON error otherwise, and required to start at all when
the daemon binds anything but loopback."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from openk3.sandbox.api import auth
from openk3.sandbox.api.client import SandboxClient
from openk3.sandbox.api.server import create_app
from openk3.sandbox.protocol import Unauthorized
from tests.sandbox.test_api import running
from tests.sandbox.test_cli_serve import ROOT, SERVE

KEY = "k3-test-key-0123456789abcdef"


def test_serving_rules():
    assert auth.check_serving("127.0.0.1", None, False) is None
    assert auth.check_serving("::1", None, False) is None
    assert auth.check_serving("localhost", None, False) is None
    refusal = auth.check_serving("0.0.0.0", None, False)
    assert refusal is not None and auth.ENV_VAR in refusal and "--no-api-key" in refusal
    assert auth.check_serving("sandbox-host.example", None, False) is not None  # a name may resolve to anything
    assert auth.check_serving("0.0.0.0", None, True) is None
    assert auth.check_serving("0.0.0.0", KEY, False) is None
    assert "at least" in (auth.check_serving("127.0.0.1", "short", False) or "")


def test_serve_refuses_a_public_bind_without_a_key(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != auth.ENV_VAR}
    state = str(tmp_path / "state")
    argv = [sys.executable, "-c", SERVE, "sandbox", "serve", "--host", "0.0.0.0", "--state-dir", state]
    done = subprocess.run(argv, env={**env, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "refusing to start" in done.stdout and auth.ENV_VAR in done.stdout, done
    assert not os.path.exists(state)  # refused before anything was mounted


@pytest.mark.sandbox
def test_requests_need_the_key(svc):
    with running(create_app(svc, workers=2, reap_interval_s=None, api_key=KEY)) as url:
        wrong: tuple[dict[str, str], ...] = (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": KEY},
            {"Authorization": f"Bearer {KEY}x"},
            {"Authorization": f"Basic {KEY}"},
        )
        for headers in (*wrong, {"Authorization": f"bearer {KEY[:-1]}"}, {"Authorization": f"Bearer{KEY}"}, {"Authorization": "Bearer"}):
            r = httpx.post(f"{url}/v1/create", json={}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "Unauthorized", headers
        assert httpx.get(f"{url}/v1/health").status_code == 401
        assert svc.backend.sandboxes() == []  # nothing ran for the refused calls
        with pytest.raises(Unauthorized, match="API key"), SandboxClient(url) as c:
            c.list_sandboxes()
        for scheme in ("bearer", "BEARER", "BeArEr", "Bearer  "):  # RFC 7235: the scheme is case-insensitive
            r = httpx.post(f"{url}/v1/list_sandboxes", json={}, headers={"Authorization": f"{scheme} {KEY}"})
            assert r.status_code == 200 and r.json() == {"result": []}, scheme
        with SandboxClient(url, api_key=KEY) as c:
            sid = c.create()
            assert c.exec(sid, "echo ok").stdout == b"ok\n"
            c.destroy(sid)

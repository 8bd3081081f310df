"""`openk3 serve` claims its port before the model loads: a port in use is an error at once, naming the address."""

from __future__ import annotations

import socket

import pytest

from openk3.cli import build_parser
from openk3.launch import cli, server


def test_a_port_in_use_is_refused_before_the_model_loads(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    loads: list[object] = []
    monkeypatch.setattr(cli, "build_server", lambda *a, **k: loads.append(a))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        args = build_parser().parse_args(["serve", "--model", "debug", "--host", "127.0.0.1", "--port", str(port)])
        assert args.func(args) == 2
    assert not loads
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_the_claimed_socket_listens_where_asked() -> None:
    args = build_parser().parse_args(["serve", "--host", "127.0.0.1", "--port", "0"])
    sock = server.claim_port(args)
    try:
        host, port = sock.getsockname()
        assert host == "127.0.0.1" and port > 0
        with socket.create_connection((host, port), timeout=5):
            pass
    finally:
        sock.close()

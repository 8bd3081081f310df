"""X-Request-Id: echoed when the client sends a well-formed one, made otherwise, on every answer (errors too)."""

from __future__ import annotations

import re


def test_a_clients_id_is_echoed(http) -> None:
    r = http.get("/v1/models", headers={"X-Request-Id": "trace-42.a"})
    assert r.headers["x-request-id"] == "trace-42.a"


def test_one_is_made_when_none_or_a_bad_one_is_sent(http) -> None:
    made = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    bad = http.get("/v1/models", headers={"X-Request-Id": "a b\tc"}).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", bad)


def test_errors_carry_it_too(http) -> None:
    r = http.post("/v1/completions", json={"prompt": "hi", "frobnicate": 1}, headers={"X-Request-Id": "e-1"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "e-1"

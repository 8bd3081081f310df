"""Connection hygiene: a client leaving mid-upload is one INFO line; a body that does not arrive in time is a 408; bodies
must be declared JSON (415); CORS only for the allowed origins; 405 names the allowed methods; GET /v1/models/{id};
/openapi.json documents the request bodies; the uvicorn bounds are `openk3 serve` flags."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest
import uvicorn

from openk3.api.connection import ConnectionConfig
from tests.api.conftest import LiveServer, start_server, stop_server

ORIGIN = "https://app.example"
BODY_TIMEOUT_S = 1.0


class Records(logging.Handler):
    """Every record of the loggers it is attached to; `seen` is set at the first one whose message has `marker`."""

    def __init__(self, marker: str) -> None:
        super().__init__(logging.DEBUG)
        self.marker = marker
        self.records: list[logging.LogRecord] = []
        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if any(r is record for r in self.records):
            return  # the same record again, from a logger above the one it was made on
        self.records.append(record)
        if self.marker in record.getMessage():
            self.seen.set()


@pytest.fixture(scope="module")
def server(torch_one_thread) -> Iterator[LiveServer]:
    connection = ConnectionConfig(body_read_timeout_s=BODY_TIMEOUT_S, allowed_origins=f"{ORIGIN}, https://other.example/")
    live = start_server(server={"connection": connection})
    yield live
    stop_server(live)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def raw(server: LiveServer, head: str, body: bytes, close: bool = False) -> bytes:
    """Send a request head and (part of) a body over a plain socket; with `close` leave at once, else read the answer."""
    url = urlsplit(server.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        s.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body)
        if close:
            return b""
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def head(path: str, length: int, content_type: str = "application/json") -> str:
    return f"POST {path} HTTP/1.1\nHost: x\nContent-Type: {content_type}\nContent-Length: {length}\nConnection: close\n"


def test_a_client_leaving_mid_upload_is_one_info_line(server: LiveServer, client: httpx.Client) -> None:
    handler = Records("client left during the request body")
    loggers = [logging.getLogger(n) for n in ("openk3.api", "uvicorn.error", "uvicorn", "")]
    api_level = loggers[0].level
    loggers[0].setLevel(logging.INFO)
    for lg in loggers:
        lg.addHandler(handler)
    try:
        raw(server, head("/v1/completions", 1000), b'{"prompt": "hel', close=True)
        assert handler.seen.wait(30), [r.getMessage() for r in handler.records]
        assert client.get("/health").status_code == 200  # the server goes on; anything the dropped request logs is in by now
    finally:
        for lg in loggers:
            lg.removeHandler(handler)
        loggers[0].setLevel(api_level)
    lines = [r for r in handler.records if r.levelno >= logging.INFO and r.name != "uvicorn.access"]
    assert len(lines) == 1, [(r.name, r.levelname, r.getMessage()) for r in lines]
    (line,) = lines
    assert line.levelno == logging.INFO and line.exc_info is None and "15 of 1000 bytes" in line.getMessage()


def test_a_body_that_does_not_arrive_in_time_is_a_408(server: LiveServer) -> None:
    # the client sends 5 of 100 bytes and then nothing: the deadline, not the client, ends the request
    answer = raw(server, head("/tokenize", 100), b'{"pro')
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 408 Request Timeout", answer[:200]
    error = json.loads(rest.partition(b"\r\n\r\n")[2])["error"]
    assert error["code"] == "request_timeout" and "--body-read-timeout-s" in error["message"]


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "application/json; charset=latin-1"]
)
def test_bodies_must_be_declared_json(client: httpx.Client, content_type: str | None) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        r = client.post(path, content=b'{"prompt": "hi"}', headers=headers)
        assert r.status_code == 415, (path, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_media_type" and "application/json" in error["message"]


def test_json_with_a_charset_is_accepted(client: httpx.Client) -> None:
    r = client.post("/tokenize", content=b'{"prompt": "hi"}', headers={"Content-Type": "Application/JSON; charset=UTF-8"})
    assert r.status_code == 200 and r.json()["count"] >= 2


def test_cors_answers_the_allowed_origins_only(client: httpx.Client) -> None:
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type,authorization"}
    for origin in (ORIGIN, "https://other.example"):
        r = client.options("/v1/completions", headers={"Origin": origin, **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
    r = client.options("/v1/completions", headers={"Origin": "https://evil.example", **preflight})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
    r = client.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in client.get("/v1/models", headers={"Origin": "https://evil.example"}).headers


def test_no_cors_by_default(http: httpx.Client) -> None:
    r = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and not any(k.startswith("access-control-") for k in r.headers)
    r = http.options("/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


def test_405_names_the_allowed_methods(client: httpx.Client) -> None:
    for method, path, allowed in (("GET", "/v1/completions", "POST"), ("DELETE", "/tokenize", "POST"), ("POST", "/v1/models", "GET")):
        r = client.request(method, path)
        assert r.status_code == 405, (method, path)
        assert allowed in r.headers["allow"]
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_models_by_id(client: httpx.Client) -> None:
    r = client.get("/v1/models/debug")
    assert r.status_code == 200
    card = r.json()
    assert card["id"] == "debug" and card["object"] == "model" and card["max_model_len"] > 0
    r = client.get("/v1/models/org/other-model")
    assert r.status_code == 404
    assert r.json()["error"] == {
        "message": "The model `org/other-model` does not exist. This server serves `debug`.",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }


def test_openapi_documents_the_request_bodies(client: httpx.Client) -> None:
    doc = client.get("/openapi.json").json()
    expected = {
        "/v1/completions": {"prompt", "max_tokens", "logprobs", "echo", "stream_options", "top_k"},
        "/v1/chat/completions": {"messages", "max_completion_tokens", "top_logprobs", "stream"},
        "/tokenize": {"prompt", "messages", "add_special_tokens"},
        "/detokenize": {"tokens"},
    }
    for path, fields in expected.items():
        body = doc["paths"][path]["post"]["requestBody"]
        schema = body["content"]["application/json"]["schema"]
        assert body["required"] and fields <= set(schema["properties"]), path
    messages = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]["messages"]
    assert "role" in messages["items"]["properties"]  # nested models are inlined ...
    assert "#/$defs/" not in json.dumps(doc)  # ... so no reference points outside the document
    assert "/v1/models/{model_id}" in doc["paths"]


def test_connection_settings_are_serve_flags() -> None:
    from openk3.api.server_flags import connection_settings
    from openk3.cli import build_parser
    from openk3.launch.server import _uvicorn_options

    defaults = connection_settings(build_parser().parse_args(["serve"]))
    assert defaults == ConnectionConfig()
    assert (defaults.timeout_keep_alive, defaults.limit_concurrency, defaults.h11_max_incomplete_event_size) == (5.0, 1024, 16384)
    assert defaults.body_read_timeout_s == 30.0 and defaults.origins == ()
    flags = "--timeout-keep-alive 7 --limit-concurrency 10 --h11-max-incomplete-event-size 4096 --body-read-timeout-s 3 --allowed-origins *"
    args = build_parser().parse_args(["serve", *flags.split()])
    assert connection_settings(args) == ConnectionConfig(
        timeout_keep_alive=7, limit_concurrency=10, h11_max_incomplete_event_size=4096, body_read_timeout_s=3, allowed_origins="*"
    )
    config = uvicorn.Config(app="openk3.api.server:create_app", **_uvicorn_options(args))
    assert (config.timeout_keep_alive, config.limit_concurrency, config.h11_max_incomplete_event_size, config.http) == (7, 10, 4096, "h11")
    assert connection_settings(args).origins == ("*",)
    with pytest.raises(ValueError, match="ConnectionConfig.allowed_origins has 'app.example'"):
        ConnectionConfig(allowed_origins="app.example")
    with pytest.raises(ValueError, match="ConnectionConfig.limit_concurrency=0 is invalid"):
        ConnectionConfig(limit_concurrency=0)

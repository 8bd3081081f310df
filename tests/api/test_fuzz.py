"""Fuzzing the request schema with hypothesis: whatever a client sends, the answer is never a 5xx, and the server stays clean."""

from __future__ import annotations

import json

import httpx
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis drives the schema fuzz test")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
VALUES = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=8)
SMALL_INTS = st.one_of(st.integers(min_value=-3, max_value=300), VALUES)
COMPLETION_FIELDS = {
    "model": st.one_of(st.just("debug"), VALUES),
    "prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(min_value=-2, max_value=300), max_size=6), VALUES),
    "max_tokens": st.one_of(st.integers(min_value=-2, max_value=4), VALUES),
    "n": st.one_of(st.integers(min_value=-1, max_value=3), VALUES),
    "temperature": st.one_of(st.floats(min_value=-1, max_value=3), VALUES),
    "top_p": st.one_of(st.floats(min_value=-0.5, max_value=1.5), VALUES),
    "top_k": SMALL_INTS,
    "min_p": VALUES,
    "seed": SMALL_INTS,
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=3), VALUES),
    "stop_token_ids": VALUES,
    "logprobs": SMALL_INTS,
    "echo": VALUES,
    "stream": st.booleans(),
    "stream_options": VALUES,
    "min_tokens": SMALL_INTS,
    "presence_penalty": VALUES,
    "repetition_penalty": VALUES,
    "ignore_eos": VALUES,
    "logit_bias": VALUES,
}
MESSAGE = st.fixed_dictionaries(
    {},
    optional={
        "role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), VALUES),
        "content": st.one_of(st.text(max_size=20), VALUES),
        "name": VALUES,
    },
)
CHAT_FIELDS = {k: v for k, v in COMPLETION_FIELDS.items() if k not in ("prompt", "echo")}
CHAT_FIELDS.update(messages=st.one_of(st.lists(MESSAGE, max_size=3), VALUES), logprobs=VALUES, top_logprobs=SMALL_INTS, max_completion_tokens=SMALL_INTS)


def bodies(fields: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional=fields).flatmap(
        lambda d: st.dictionaries(st.text(max_size=8), VALUES, max_size=2).map(lambda extra: {**extra, **d})
    )


def send(client: httpx.Client, path: str, body: dict) -> None:
    content = json.dumps(body).encode()  # NaN and Infinity are spelled as Python's json does; the server must cope
    try:
        with client.stream("POST", path, content=content, headers={"Content-Type": "application/json"}) as r:
            assert r.status_code < 500, (r.status_code, r.read())
            if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
                for line in r.iter_lines():
                    assert '"type":"server_error"' not in line, line
                    break  # leave mid-stream: the request is aborted
    except httpx.ReadTimeout:
        pass  # a valid request still generating; the client leaves and the server aborts it


@pytest.fixture(scope="module")
def fuzz_client(live):
    with httpx.Client(base_url=live.base_url, timeout=httpx.Timeout(5.0, read=1.0)) as c:
        yield c


FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(body=bodies(COMPLETION_FIELDS))
def test_completions_schema_never_5xx(fuzz_client, body) -> None:
    send(fuzz_client, "/v1/completions", body)


@FUZZ
@given(body=bodies(CHAT_FIELDS))
def test_chat_schema_never_5xx(fuzz_client, body) -> None:
    send(fuzz_client, "/v1/chat/completions", body)


def test_clean_after_fuzzing(live, fuzz_client) -> None:
    assert fuzz_client.get("/health").status_code == 200
    live.check_idle_and_free(timeout=30)

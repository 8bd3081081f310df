"""The Responses store's eviction order (least recently used first, a lookup counts as use) and its 404s, exactly."""

from __future__ import annotations

import pytest

from openk3.api.errors import APIError
from openk3.api.protocol import ChatMessage
from openk3.api.responses_store import ResponseStore


def turn(text: str) -> tuple[ChatMessage, ...]:
    return (ChatMessage(role="user", content=text),)


def missing(store: ResponseStore, response_id: str) -> str:
    with pytest.raises(APIError) as caught:
        store.get(response_id)
    e = caught.value
    assert (e.status, e.param, e.code) == (404, "previous_response_id", "previous_response_not_found") and repr(response_id) in e.message
    return e.message


def test_least_recently_used_goes_first_and_is_remembered_as_evicted() -> None:
    store = ResponseStore(capacity=2)
    store.put("a", turn("1"))
    store.put("b", turn("2"))
    assert store.get("a") == turn("1")  # a is now the most recently used
    store.put("c", turn("3"))
    assert len(store) == 2 and store.get("a") == turn("1") and store.get("c") == turn("3")
    assert "evicted" in missing(store, "b") and "2 most recently used" in missing(store, "b")
    assert "no such response" in missing(store, "zzz")


def test_evicted_ids_are_remembered_up_to_the_capacity() -> None:
    store = ResponseStore(capacity=1)
    for name in "abc":
        store.put(name, turn(name))
    assert "no such response" in missing(store, "a")  # forgotten: only the last `capacity` evicted ids are kept
    assert "evicted" in missing(store, "b")


def test_a_store_holds_at_least_one() -> None:
    with pytest.raises(ValueError, match="capacity=0"):
        ResponseStore(capacity=0)

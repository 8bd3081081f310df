"""The Responses store's eviction order (least recently used first, a lookup counts as use), deletion and its 404s, exactly."""

from __future__ import annotations

import pytest

from openk3.api.errors import APIError
from openk3.api.protocol import ChatMessage
from openk3.api.responses_store import ResponseStore, StoredResponse


def turn(text: str) -> StoredResponse:
    return StoredResponse({"id": text}, (ChatMessage(role="user", content=text),), ({"id": f"msg_{text}"},))


def missing(store: ResponseStore, response_id: str) -> str:
    with pytest.raises(APIError) as caught:
        store.conversation(response_id)
    e = caught.value
    assert (e.status, e.param, e.code) == (404, "previous_response_id", "previous_response_not_found") and repr(response_id) in e.message
    with pytest.raises(APIError) as again:
        store.get(response_id)
    assert (again.value.status, again.value.param, again.value.code) == (404, "response_id", "response_not_found")
    return e.message


def test_least_recently_used_goes_first_and_is_remembered_as_evicted() -> None:
    store = ResponseStore(capacity=2)
    store.put("a", turn("1"))
    store.put("b", turn("2"))
    assert store.conversation("a") == turn("1").messages  # a is now the most recently used
    store.put("c", turn("3"))
    assert len(store) == 2 and store.get("a") == turn("1") and store.get("c") == turn("3")
    assert "evicted" in missing(store, "b") and "2 most recently used" in missing(store, "b")
    assert "no such response" in missing(store, "zzz")


def test_get_counts_as_use() -> None:
    store = ResponseStore(capacity=2)
    store.put("a", turn("1"))
    store.put("b", turn("2"))
    store.get("a")
    store.put("c", turn("3"))
    assert "evicted" in missing(store, "b") and store.get("a").response == {"id": "1"}


def test_a_deleted_response_is_gone_and_frees_its_place() -> None:
    store = ResponseStore(capacity=2)
    store.put("a", turn("1"))
    store.put("b", turn("2"))
    store.delete("a")
    assert len(store) == 1 and "deleted" in missing(store, "a")
    store.put("c", turn("3"))
    assert store.get("b") == turn("2")  # nothing evicted: the deleted one made room
    with pytest.raises(APIError) as caught:
        store.delete("a")
    assert caught.value.status == 404


def test_evicted_ids_are_remembered_up_to_the_capacity() -> None:
    store = ResponseStore(capacity=1)
    for name in "abc":
        store.put(name, turn(name))
    assert "no such response" in missing(store, "a")  # forgotten: only the last `capacity` evicted ids are kept
    assert "evicted" in missing(store, "b")


def test_a_store_holds_at_least_one() -> None:
    with pytest.raises(ValueError, match="capacity=0"):
        ResponseStore(capacity=0)

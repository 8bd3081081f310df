"""The Responses API's memory: the last `capacity` stored responses, in memory, least recently used out first. What
`previous_response_id` continues and what `GET` / `DELETE /v1/responses/{id}` and `GET /v1/responses/{id}/input_items`
read.

A stored response keeps the Response object as it was returned, the input items its request sent (with ids), and its
conversation as chat messages (its input after the earlier turns, then its own output as one assistant message, without
its instructions); a chain of responses shares the earlier messages' objects, so a long chain costs a list of references
per response, not a copy of the text. The ids of evicted responses are remembered (ids only, as many again) so that asking
for one is a 404 saying it was evicted, not that it never existed; a deleted response is simply gone.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from openk3.api.errors import APIError
from openk3.api.protocol import ChatMessage

DEFAULT_CAPACITY = 1024


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object's JSON, as the request that made it was answered
    messages: tuple[ChatMessage, ...]  # the conversation up to and including this response's output
    input_items: tuple[dict[str, Any], ...]  # this request's own input, as items with ids (not the earlier turns')


class ResponseStore:
    """Used on the event loop only (no lock): no method awaits."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"ResponseStore.capacity={capacity}: must be at least 1")
        self.capacity = capacity
        self._stored: OrderedDict[str, StoredResponse] = OrderedDict()
        self._evicted: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._stored)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        self._stored[response_id] = stored
        self._stored.move_to_end(response_id)
        while len(self._stored) > self.capacity:
            old, _ = self._stored.popitem(last=False)
            self._evicted[old] = None
            if len(self._evicted) > self.capacity:
                self._evicted.popitem(last=False)

    def conversation(self, response_id: str) -> tuple[ChatMessage, ...]:
        """The conversation up to and including that response, for `previous_response_id`; a 404 naming the id and why
        it is not here."""
        found = self._stored.get(response_id)
        if found is None:
            message = f"previous_response_id {response_id!r} not found: {self._why(response_id)}; send the whole conversation as input instead"
            raise APIError(404, message, param="previous_response_id", code="previous_response_not_found")
        self._stored.move_to_end(response_id)
        return found.messages

    def get(self, response_id: str) -> StoredResponse:
        """The stored response (a lookup counts as use), or a 404 naming the id and why it is not here."""
        found = self._stored.get(response_id)
        if found is None:
            raise APIError(404, f"response {response_id!r} not found: {self._why(response_id)}", param="response_id", code="response_not_found")
        self._stored.move_to_end(response_id)
        return found

    def delete(self, response_id: str) -> None:
        """Forget the response (a later lookup says there is no such response), or a 404 as `get`'s."""
        self.get(response_id)
        del self._stored[response_id]

    def _why(self, response_id: str) -> str:
        if response_id in self._evicted:
            return f"it was evicted from this server's response store, which keeps the {self.capacity} most recently used responses"
        return "this server has no such response (it was made with store: false, deleted, made by another server, or before a restart)"

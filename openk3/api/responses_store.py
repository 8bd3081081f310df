"""The Responses API's memory for `previous_response_id`: the last `capacity` stored responses' conversations, in memory,
least recently used out first.

A stored response keeps its conversation as chat messages (its input after the earlier turns, then its own output as one
assistant message, without its instructions); a chain of responses shares the earlier messages' objects, so a long chain
costs a list of references per response, not a copy of the text. The ids of evicted responses are remembered (ids only,
as many again) so that asking for one is a 4xx saying it was evicted, not that it never existed.
"""

from __future__ import annotations

from collections import OrderedDict

from openk3.api.errors import APIError
from openk3.api.protocol import ChatMessage

DEFAULT_CAPACITY = 1024


class ResponseStore:
    """Used on the event loop only (no lock): `get` and `put` do not await."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"ResponseStore.capacity={capacity}: must be at least 1")
        self.capacity = capacity
        self._conversations: OrderedDict[str, tuple[ChatMessage, ...]] = OrderedDict()
        self._evicted: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._conversations)

    def put(self, response_id: str, messages: tuple[ChatMessage, ...]) -> None:
        self._conversations[response_id] = messages
        self._conversations.move_to_end(response_id)
        while len(self._conversations) > self.capacity:
            old, _ = self._conversations.popitem(last=False)
            self._evicted[old] = None
            if len(self._evicted) > self.capacity:
                self._evicted.popitem(last=False)

    def get(self, response_id: str) -> tuple[ChatMessage, ...]:
        """The conversation up to and including that response, or a 404 naming the id and why it is not here."""
        found = self._conversations.get(response_id)
        if found is not None:
            self._conversations.move_to_end(response_id)
            return found
        if response_id in self._evicted:
            why = f"it was evicted from this server's response store, which keeps the {self.capacity} most recently used responses"
        else:
            why = "this server has no such response (it was made with store: false, by another server, or before a restart)"
        message = f"previous_response_id {response_id!r} not found: {why}; send the whole conversation as input instead"
        raise APIError(404, message, param="previous_response_id", code="previous_response_not_found")

"""Past responses kept in memory for GET /v1/responses/{id} and previous_response_id:
the last MAX_STORED of them, the oldest dropped first, and nothing past a restart."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# A stored conversation fitted the context when it was answered, so each entry is bounded by
# the context's text plus one answer; the count bounds the whole.
MAX_STORED = 256


@dataclass(frozen=True)
class StoredResponse:
    body: dict             # the response object as it was returned
    conversation: list     # every Chat Completions message so far (instructions left out), answer included


class ResponseStore:
    """The last `capacity` responses by id. Used from the event loop only, so no lock."""

    def __init__(self, capacity: int = MAX_STORED):
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        """Keep a response, dropping the oldest beyond capacity."""
        self._entries[response_id] = entry
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, or None (never stored, deleted, or dropped as the oldest)."""
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        """Forget a response; whether it was there."""
        return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        return len(self._entries)

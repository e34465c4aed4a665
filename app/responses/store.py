"""Responses kept for `GET /v1/responses/{id}` and `previous_response_id`: bounded in entries and bytes.

The oldest entry goes first when either cap is reached, so the store never grows with traffic; an evicted id
answers `previous_response_not_found` like one that never existed. A socket keeps its own few last responses
in one of these too (also those sent with `store: false`). A response streamed over a socket is kept from its
start, in progress (GET shows it so; a DELETE then wins over its end: `complete` keeps nothing it no longer holds).
"""
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

MESSAGE_OVERHEAD_BYTES = 64  # a message's role and dict, roughly, beside its text


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the response object, as answered
    history: tuple[dict, ...]  # the conversation it continues plus its output: {role, content} messages (and calls)
    num_bytes: int

    @classmethod
    def of(cls, response: dict, history: tuple[dict, ...]) -> "StoredResponse":
        size = len(json.dumps(response, ensure_ascii=False).encode("utf-8", "surrogatepass"))
        size += sum(_message_bytes(m) + MESSAGE_OVERHEAD_BYTES for m in history)
        return cls(response, history, size)


def _message_bytes(message: dict) -> int:
    """Its text, and its tool calls where it has them (content null)."""
    calls = message.get("tool_calls")
    text = (message["content"] or "") + (json.dumps(calls, ensure_ascii=False) if calls else "")
    return len(text.encode("utf-8", "surrogatepass"))


class ResponseStore:
    """Thread-safe: REST handlers and socket sessions share the server's store."""

    def __init__(self, max_entries: int, max_bytes: int):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()

    def put(self, stored: StoredResponse) -> bool:
        """Keep it, evicting the oldest as needed; False if it alone is larger than the store."""
        with self._lock:
            return self._put(stored)

    def complete(self, stored: StoredResponse) -> bool:
        """Replace the response's in-progress entry with its final form, only while that entry is still held:
        a response deleted (or evicted) while it was made stays gone."""
        with self._lock:
            return stored.response["id"] in self._entries and self._put(stored)

    def _put(self, stored: StoredResponse) -> bool:
        if stored.num_bytes > self.max_bytes or self.max_entries < 1:
            self._remove(stored.response["id"])  # not its older form either
            return False
        self._remove(stored.response["id"])
        self._entries[stored.response["id"]] = stored
        self._num_bytes += stored.num_bytes
        while len(self._entries) > self.max_entries or self._num_bytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._remove(response_id)

    def _remove(self, response_id: str) -> bool:
        stored = self._entries.pop(response_id, None)
        if stored is None:
            return False
        self._num_bytes -= stored.num_bytes
        return True

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def __len__(self) -> int:
        return len(self._entries)

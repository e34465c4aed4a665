"""Incremental, UTF-8-safe detokenization with stop strings, one instance per request.

Text is decoded from a sliding window of token ids (`prefix_offset`..end) so each step is
O(window), and a piece is released only when it does not end in U+FFFD (a character still
split across tokens). Stop strings are searched in the decoded text; the last
`max(len(stop)) - 1` characters are held back so no part of a stop string is ever streamed.
Stop strings count only past the request's `min_tokens`, as in vLLM.
"""
from functools import lru_cache

REPLACEMENT_CHAR = "\ufffd"
TOKEN_CACHE_SIZE = 65536


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # decoded so far, stop string removed once found
        self.num_released = 0  # characters of `text` already handed out
        self.stopped_by: str | None = None

    def add_token(self, token_id: int) -> str:
        """Feed one token; return the new text that is safe to stream now (maybe empty)."""
        self.token_ids.append(token_id)
        self.text += self._decode_new_piece()
        if self._checks_stop and self._truncate_at_stop():
            return self._release(len(self.text))
        return self._release(len(self.text) - self.hold_back)

    def flush(self) -> str:
        """At the end of a request: decode what is left (even an incomplete character) and release it all."""
        if self.stopped_by is None:
            self.text += self._decode(self.prefix_offset, len(self.token_ids))[
                len(self._decode(self.prefix_offset, self.read_offset)):]
            self.read_offset = len(self.token_ids)
            if self._checks_stop:
                self._truncate_at_stop()
        return self._release(len(self.text))

    @property
    def _checks_stop(self) -> bool:
        return bool(self.stop) and len(self.token_ids) > self.min_tokens

    def _decode_new_piece(self) -> str:
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        full_text = self._decode(self.prefix_offset, len(self.token_ids))
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full_text[len(prefix_text):]

    def _truncate_at_stop(self) -> bool:
        # A stop string can only end inside the unreleased tail, plus the overlap it may span.
        search_from = max(0, self.num_released - self.hold_back)
        found = [(self.text.find(s, search_from), s) for s in self.stop]
        found = [(i, s) for i, s in found if i >= 0]
        if not found:
            return False
        index, self.stopped_by = min(found)
        self.text = self.text[:index]
        return True

    def _release(self, upto: int) -> str:
        if upto <= self.num_released:
            return ""
        piece = self.text[self.num_released:upto]
        self.num_released = upto
        return piece

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=True)


class TokenTexts:
    """A token's own text and bytes, for log-probabilities (OpenAI's `token` and `bytes`). Byte-level
    vocabularies (GPT-2, SmolLM2) spell each byte as one character, so a token that ends inside a UTF-8
    character still has its exact bytes; its text shows the incomplete part as U+FFFD."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._byte_of = _byte_decoder() if type(tokenizer.backend_tokenizer.decoder).__name__ == "ByteLevel" \
            else None
        self._special = {i for i, t in tokenizer.backend_tokenizer.get_added_tokens_decoder().items()}
        self.token_bytes = lru_cache(maxsize=TOKEN_CACHE_SIZE)(self._token_bytes)

    def text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _token_bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._special or self._byte_of is None or not all(c in self._byte_of for c in piece):
            return (piece if token_id in self._special else self.tokenizer.decode([token_id])).encode("utf-8")
        return bytes(self._byte_of[c] for c in piece)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars

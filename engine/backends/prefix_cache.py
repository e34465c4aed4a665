"""The transformers backend's prefix cache: keys and values of past prompts and answers, kept in blocks of
BLOCK_TOKENS tokens so a new request that starts with the same tokens (the next turn of a chat resends the whole
conversation) prefills only what follows them.

Blocks are keyed as vLLM's automatic prefix caching keys them: a hash chain, each block's key a digest of its
parent's key and its own tokens, rooted in the request's `cache_salt` (requests with different salts never share
a block: a shared prefix is a timing side channel between users). BLAKE2b, not Python's hash: a key must not be
forgeable, or one user could be handed another's keys and values. The pool holds at most `max_tokens` tokens;
the least recently used block goes first, and a chain is touched from its last block to its first, so a prefix
outlives the blocks that extend it (no block is kept whose parent is gone for long). The pool shares the worker's
KV budget with the running rows: `fit` shrinks it to what they leave (the rows never wait for the cache).

Exact only where a prompt's keys and values do not depend on how it was chunked: the 4-bit path computes a
chunk as decode steps, so a prompt resumed from cached blocks computes the bits it would have from scratch
(the backend turns the cache on only there)."""
import hashlib
import logging
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

BLOCK_TOKENS = 32  # a multiple of q4.KEY_BLOCK: a block's keys are whole key blocks of the 4-bit path


@dataclass(frozen=True)
class CachedBlock:
    keys: torch.Tensor  # [layers, kv_heads, BLOCK_TOKENS, head_dim]
    values: torch.Tensor


# One sequence's keys and values per layer, each [kv_heads, >= its length, head_dim] (a view into a cache).
LayerViews = Sequence[tuple[torch.Tensor, torch.Tensor]]


class PrefixCache:
    def __init__(self, max_tokens: int, block_tokens: int = BLOCK_TOKENS):
        self.block_tokens = block_tokens
        self.limit_blocks = max(0, max_tokens // block_tokens)  # the configured bound
        self.max_blocks = self.limit_blocks  # the bound now: what the running rows leave of the KV budget
        self._blocks: OrderedDict[bytes, CachedBlock] = OrderedDict()
        self.queried_tokens = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hit_tokens = 0  # of them, found cached (prefix_cache_hits)

    @property
    def num_tokens(self) -> int:
        return len(self._blocks) * self.block_tokens

    def block_keys(self, token_ids: Sequence[int], salt: str | None, num_blocks: int) -> list[bytes]:
        keys, parent = [], hashlib.blake2b((salt or "").encode(), digest_size=16).digest()
        for block in range(num_blocks):
            tokens = token_ids[block * self.block_tokens:(block + 1) * self.block_tokens]
            parent = hashlib.blake2b(parent + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16).digest()
            keys.append(parent)
        return keys

    def lookup(self, token_ids: Sequence[int], salt: str | None) -> list[CachedBlock]:
        """The blocks of the longest cached prefix of `token_ids`, leaving at least its last token to compute
        (its logits pick the next token)."""
        self.queried_tokens += len(token_ids)
        keys = self.block_keys(token_ids, salt, (len(token_ids) - 1) // self.block_tokens)
        found = []
        for key in keys:
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(block)
        self._touch(keys[:len(found)])
        self.hit_tokens += len(found) * self.block_tokens
        return found

    def insert(self, token_ids: Sequence[int], salt: str | None, layers: LayerViews) -> None:
        """Keep the whole blocks of a sequence whose first len(token_ids) positions `layers` hold."""
        if self.max_blocks == 0:
            return
        keys = self.block_keys(token_ids, salt, min(len(token_ids) // self.block_tokens, self.max_blocks))
        for index, key in enumerate(keys):
            if key not in self._blocks:
                span = slice(index * self.block_tokens, (index + 1) * self.block_tokens)
                self._blocks[key] = CachedBlock(torch.stack([k[:, span] for k, _ in layers]),
                                                torch.stack([v[:, span] for _, v in layers]))
        self._touch(keys)
        self._evict()

    def fit(self, free_tokens: int) -> int:
        """Bound the pool by `free_tokens` positions (never past its configured bound), evicting the least recently
        used blocks; returns how many blocks went."""
        self.max_blocks = min(self.limit_blocks, max(0, free_tokens) // self.block_tokens)
        return self._evict()

    def _evict(self) -> int:
        evicted = 0
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
            evicted += 1
        return evicted

    def clear(self) -> None:
        self._blocks.clear()

    def _touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):  # the first block ends most recent: prefixes are evicted last
            self._blocks.move_to_end(key)


def restore(blocks: list[CachedBlock], keys: torch.Tensor, values: torch.Tensor) -> int:
    """Copy cached blocks into the first positions of a sequence's keys and values (each [layers, kv_heads,
    capacity, head_dim], every layer in one tensor: one copy a block); returns how many positions."""
    positions = 0
    for block in blocks:
        span = slice(positions, positions + block.keys.shape[2])
        keys[:, :, span] = block.keys
        values[:, :, span] = block.values
        positions = span.stop
    return positions

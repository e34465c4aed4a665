"""The decoding batch's keys and values, and the attention that reads them: two caches behind one interface.

RowKVCache, on the 4-bit path (the default on CPU): each row keeps its prompt's own cache, so the batch holds the
sum of its rows' lengths. SlotKVCache elsewhere: one preallocated tensor per layer, padded to the longest row.

In the slot cache each decoding row owns a slot: per layer, keys and values live in one tensor
[slots, kv_heads, capacity, head_dim] that a decode step writes in place (one indexed store per layer, at each
row's own position) and reads as the first `num_rows` slots, a contiguous view. Nothing is concatenated per step and
no row is ever re-padded when another joins or leaves: a row that leaves is replaced by the last one (one row
copied). The storage grows in whole pages of positions and in groups of slots, so its shape changes rarely, and
shrinks when the longest row leaves. A step attends over the whole capacity: a view of fewer positions is not
contiguous, and the CPU matmuls would copy every row's keys and values first (measured in docs/benchmarks.md, "The
decode step's design"). Rows are left-aligned (position p of a row is column p); positions past a row's length hold
zeros and are masked with -inf. Where the 4-bit kernels read a slot cache (the lean forward takes either), its keys
lie in blocks of q4.KEY_BLOCK positions inside the same shape, and a row's copy takes whole blocks.

`slot_attention` computes a decode step's attention with two matmuls grouped by KV head, instead of SDPA's kernel:
every row's result is bit-identical whatever the other rows, the batch size or the span (each score is one dot
product; masked positions add exact zeros), the basis of batch-invariant greedy decoding.
"""
import logging
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .q4 import KEY_BLOCK, PromptCache, SlotTables

logger = logging.getLogger(__name__)

SLOT_ATTENTION = "lockstep_slots"
# A multiple of q4.KEY_BLOCK; capacity grows (and shrinks) in multiples of this many positions (every step reads all
# of it, so larger pages slow short answers; growing copies the cache, so smaller pages copy more often).
PAGE_TOKENS = 64
SLOT_GROUP = 2  # slots are allocated in pairs: at most one row's worth unused (the KV budget counts rows)
SHRINK_AFTER_TOKENS = 2 * PAGE_TOKENS  # positions per slot no row needs any more before the storage shrinks
# Memory that keys and values leave to the rest of the server when a limit binds: the HTTP side's requests, a step's
# activations and logits, glibc's free lists, cached prefix blocks copied before the pool is trimmed. This much, and
# a quarter of what was left: with an eighth, 16 prompts of 3,500 tokens in a 1 GiB limit peaked 62 MB under it.
KV_MEMORY_RESERVE = 64 << 20
KV_MEMORY_RESERVE_SHARE = 4  # 1 / this of the headroom
MIN_CONTEXT = 512  # the least context a memory limit may leave before the server warns it will be killed


@dataclass(frozen=True)
class KVBudget:
    positions: int  # keys and values of the whole batch: rows, prompts being fed, cached prefixes
    context: int  # one request's prompt and answer
    reason: str = ""  # why less than configured; "" where the configured budget fits


def kv_budget_within(headroom: int | None, bytes_per_position: int, positions: int, context: int,
                     lone_slots: int = 1) -> KVBudget:
    """The budget and context that fit in what memory leaves beside the loaded model (`headroom` bytes; None:
    unknown), never more than configured. A prompt's keys and values are copied into its slot when it joins the batch,
    so the batch's budget and one whole context must fit together, and a request alone (which always runs) holds
    `lone_slots` slots of its context (a padding row where decode never runs at one row). Where they do not fit, the
    context gets 1 / (lone_slots + 1) of what does (at least MIN_CONTEXT), the budget the rest."""
    if headroom is None:
        return KVBudget(positions, context)
    fit = max(0, headroom - KV_MEMORY_RESERVE - headroom // KV_MEMORY_RESERVE_SHARE) // bytes_per_position
    if max(positions, lone_slots * context) + context <= fit:
        return KVBudget(positions, context)
    fit_context = min(context, max(MIN_CONTEXT, fit // (lone_slots + 1)))
    fit_positions = min(positions, max(lone_slots * fit_context, fit - fit_context))
    reason = (f"memory leaves {headroom >> 20} MB beside the model: keys and values of up to {fit_positions} "
              f"positions ({fit_positions * bytes_per_position >> 20} MB) and a context of {fit_context} tokens "
              f"(configured {positions} and {context})")
    if max(fit_positions, lone_slots * fit_context) + fit_context > fit:
        reason += f"; too little for even {MIN_CONTEXT} tokens: the kernel may throttle or kill the model worker"
    return KVBudget(fit_positions, fit_context, reason)


class SlotKVCache(Cache):
    """The decoding batch's keys and values; `update` is what the model's attention layers call.

    Row i of the batch is slot i; `lengths[i]` tokens of it are cached (host-side ints: a step needs no
    device-to-host copy to plan itself)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_positions: float = float("inf")):
        super().__init__(layers=[])
        self.max_positions = max_positions  # the KV budget: no spare slot that would take the storage past it
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths: list[int] = []
        self.reallocations = 0  # times the storage changed shape (the old one freed)
        self._step_rows = 0  # rows the current decode step computes (padding rows included)
        self._step_index: torch.Tensor | None = None  # [step rows]: slot of each input row
        self._step_positions: torch.Tensor | None = None  # [step rows]: where each row's new token goes
        self._tables: tuple[tuple, SlotTables] | None = None  # see `slot_tables`

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    @property
    def num_slots(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    @property
    def positions(self) -> int:
        """Positions of keys and values held: every slot's whole capacity (the KV budget's count)."""
        return self.num_slots * self.capacity

    def slot_tables(self) -> SlotTables:
        """Where the 4-bit kernels find each slot, made again only when the storage changes (~80 us, 1% of a
        one-row step)."""
        key = (tuple(t.data_ptr() for t in (*self.keys, *self.values)), self.keys[0].shape)
        if self._tables is None or self._tables[0] != key:
            self._tables = key, SlotTables([(self.keys, self.values)])
        return self._tables[1]

    def add_row(self, layers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> int:
        """Copy one sequence's cache (per layer [1, kv_heads, >= length, head_dim], length >= 1) into the
        next slot; returns the row's index."""
        row = self.num_rows
        self._reserve(row + 1, length + 1)
        copied = min(layers[0][0].shape[2], _round_up(length, KEY_BLOCK))  # the 4-bit path's keys: whole blocks
        for layer, (keys, values) in enumerate(layers):
            self.keys[layer][row, :, :copied] = keys[0, :, :copied]
            self.values[layer][row, :, :copied] = values[0, :, :copied]
        self.lengths.append(length)
        return row

    def row_views(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row `row`'s keys and values per layer, [kv_heads, capacity, head_dim] views."""
        return [(keys[row], values[row]) for keys, values in zip(self.keys, self.values)]

    def remove_rows(self, rows: set[int]) -> list[tuple[int, int]]:
        """Free `rows`; the last rows move into the holes. Returns the moves as (from, to), which the
        caller applies to its own list of rows, in order."""
        old_count, keep_count = self.num_rows, self.num_rows - len(rows)
        holes = sorted(r for r in rows if r < keep_count)
        movers = [r for r in range(keep_count, old_count) if r not in rows]
        moves = list(zip(movers, holes))
        for source, target in moves:
            for storage in self.keys + self.values:
                storage[target].copy_(storage[source])
            self.lengths[target] = self.lengths[source]
        del self.lengths[keep_count:]
        for storage in self.keys + self.values:  # freed slots must read as zeros (0 * garbage may be NaN)
            storage[keep_count:old_count].zero_()
        return moves

    def shrink(self) -> int:
        """Drop positions and slots the remaining rows no longer need (the longest row left: every step
        attends over the whole capacity). Returns how many positions per slot were freed."""
        if not self.lengths:
            freed = self.capacity
            self.keys, self.values = [], []
            return freed
        target_capacity = _round_up(max(self.lengths) + 1, PAGE_TOKENS)
        target_slots = self._slots_for(self.num_rows, target_capacity, self.num_rows)
        freed = self.capacity - target_capacity
        if freed < SHRINK_AFTER_TOKENS and self.num_slots - target_slots < 2 * SLOT_GROUP:
            return 0
        self._reallocate(target_slots, target_capacity)
        return freed

    def prepare_decode(self, min_rows: int = 1, with_mask: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Before a decode step over every row, padded with empty rows to `min_rows` (whose outputs the
        caller ignores): room for one more token per row. Returns (position_ids [B, 1], the additive
        attention mask [B, 1, 1, capacity] that hides every row's unused positions, or None without
        `with_mask`)."""
        step_lengths = self.lengths + [0] * (min_rows - self.num_rows)
        self._reserve(len(step_lengths), max(step_lengths) + 1)
        self._step_rows = len(step_lengths)
        self._step_index = torch.arange(self._step_rows, device=self.device)
        self._step_positions = torch.tensor(step_lengths, device=self.device)
        if not with_mask:
            return self._step_positions[:, None], None
        columns = torch.arange(self.capacity, device=self.device)
        hidden = columns[None, :] > self._step_positions[:, None]  # the token being fed sees itself
        mask = torch.zeros(hidden.shape, dtype=self.dtype, device=self.device).masked_fill_(hidden, float("-inf"))
        return self._step_positions[:, None], mask[:, None, None, :]

    @property
    def step_slots(self) -> torch.Tensor:
        """[step rows]: the slot of each row of the step `prepare_decode` prepared (row i: slot i)."""
        return self._step_index

    def finish_decode(self) -> None:
        """After the step: each real row holds one more token. A padding row wrote position 0 of a free
        slot, which the next row to take that slot overwrites (every row has at least one token)."""
        self.lengths = [length + 1 for length in self.lengths]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the fed token's keys and values ([B, kv_heads, 1, head_dim]) at each row's position and
        return every row's slot (a contiguous view)."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        keys[self._step_index, :, self._step_positions] = key_states[:, :, 0]
        values[self._step_index, :, self._step_positions] = value_states[:, :, 0]
        return keys[:self._step_rows], values[:self._step_rows]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.capacity

    def _reserve(self, rows: int, positions: int) -> None:
        if rows <= self.num_slots and positions <= self.capacity:
            return
        capacity = max(self.capacity, _round_up(positions, PAGE_TOKENS))
        self._reallocate(self._slots_for(rows, capacity, max(self.num_slots, rows)), capacity)

    def _slots_for(self, rows: int, capacity: int, least: int) -> int:
        """`least` slots (at least `rows`) rounded up to a pair, fewer where that takes the storage past the KV budget:
        down to the rows' own (a long row alone in a memory limit would otherwise hold twice its keys and values)."""
        for slots in (_round_up(least, SLOT_GROUP), least):
            if slots * capacity <= self.max_positions:
                return slots
        return rows

    def _reallocate(self, slots: int, capacity: int) -> None:
        logger.debug("KV slots: %d x %d positions -> %d x %d", self.num_slots, self.capacity, slots, capacity)
        shape = (slots, self.num_kv_heads, capacity, self.head_dim)
        rows, kept = min(self.num_rows, slots), min(self.capacity, capacity)
        self.reallocations += 1
        if not self.keys:
            self.keys, self.values = [None] * self.num_layers, [None] * self.num_layers
        for layer in range(self.num_layers):  # a layer at a time: the old and new storage never coexist whole
            for stored in (self.keys, self.values):
                fresh = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if stored[layer] is not None:
                    fresh[:rows, :, :kept] = stored[layer][:rows, :, :kept]
                stored[layer] = fresh


class RowKVCache:
    """The decoding batch's keys and values on the 4-bit path: each row keeps its prompt's own cache (q4.PromptCache,
    sized for the prompt and its answer when the prompt arrives), and the kernels find each row through a table of
    addresses, attending to that row's own positions. The batch then holds the sum of its rows' lengths, not rows x
    the longest (SlotKVCache's one tensor): one long request leaves the KV budget to many short ones beside it. A row
    joins with its prompt's cache as it is (a fork of n > 1 copies it) and leaves by dropping it: nothing is copied
    per step or when another row comes or goes.

    The same interface as SlotKVCache where the backend uses it; rows are never padded (the 4-bit kernels compute
    each row as it is alone), so no mask and no padding rows."""

    def __init__(self):
        self.rows: list[PromptCache] = []
        self.lengths: list[int] = []  # tokens cached per row
        self.reallocations = 0  # rows that outgrew what their prompt reserved (copied into a larger cache)
        self._freed = 0  # positions the rows that left held, since `shrink` last said
        self._tables: SlotTables | None = None  # made when the rows change

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    @property
    def positions(self) -> int:
        """Positions of keys and values held: every row's own capacity (the KV budget's count)."""
        return sum(row.capacity for row in self.rows)

    def add_row(self, cache: PromptCache, length: int) -> int:
        """The row takes `cache` (its first `length` positions filled) as its own; returns the row's index."""
        self.rows.append(cache)
        self.lengths.append(length)
        self._tables = None
        return self.num_rows - 1

    def row_views(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row `row`'s keys and values per layer, [kv_heads, capacity, head_dim] views."""
        return [(keys[0], values[0]) for keys, values in zip(self.rows[row].keys, self.rows[row].values)]

    def remove_rows(self, rows: set[int]) -> list[tuple[int, int]]:
        """Drop `rows`; the last rows move into the holes (as SlotKVCache's). Returns the moves as (from, to)."""
        keep_count = self.num_rows - len(rows)
        holes = sorted(r for r in rows if r < keep_count)
        movers = [r for r in range(keep_count, self.num_rows) if r not in rows]
        self._freed += sum(self.rows[r].capacity for r in rows)
        moves = list(zip(movers, holes))
        for source, target in moves:
            self.rows[target], self.lengths[target] = self.rows[source], self.lengths[source]
        del self.rows[keep_count:], self.lengths[keep_count:]
        self._tables = None
        return moves

    def shrink(self) -> int:
        """Nothing is padded: returns the positions the rows that left since the last call held."""
        freed, self._freed = self._freed, 0
        return freed

    def prepare_decode(self, min_rows: int = 1, with_mask: bool = False) -> tuple[torch.Tensor, None]:
        """Before a decode step over every row: room for one more token in each. Returns position_ids [B, 1]."""
        if min_rows > self.num_rows or with_mask:
            raise ValueError("rows in caches of their own are decoded by the 4-bit kernels alone: no padding, no mask")
        for row, length in enumerate(self.lengths):
            if length >= self.rows[row].capacity:  # past what its request reserved: never expected, never unsafe
                self.rows[row] = self.rows[row].copy(length, _round_up(length + 1, PAGE_TOKENS))
                self.reallocations += 1
                self._tables = None
        return torch.tensor(self.lengths)[:, None], None

    @property
    def step_slots(self) -> torch.Tensor:
        return torch.arange(self.num_rows)

    def finish_decode(self) -> None:
        self.lengths = [length + 1 for length in self.lengths]

    def slot_tables(self) -> SlotTables:
        if self._tables is None:
            self._tables = SlotTables([(row.keys, row.values) for row in self.rows])
        return self._tables


def slot_attention(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                   **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention interface. One query token per row (a decode step): grouped-query attention
    as two matmuls, no KV heads repeated. Longer queries (prompt chunks) go to SDPA."""
    batch, num_heads, query_len, head_dim = query.shape
    if query_len != 1:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    output = one_query_attention(query, key, value, attention_mask, head_dim ** -0.5 if scaling is None else scaling)
    return output.reshape(batch, 1, num_heads, head_dim), None


def one_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Grouped-query attention of one query token per row over its keys and values ([B, kv_heads, span,
    head_dim]), no KV heads repeated: query [B, heads, (1,) head_dim] -> [B, kv_heads, group, head_dim] (heads in
    their order). attention_mask: additive [B, 1, 1, span], or boolean (True: attend)."""
    batch, num_kv_heads, _, head_dim = key.shape
    grouped = query.reshape(batch, num_kv_heads, -1, head_dim)
    scores = torch.matmul(grouped, key.transpose(2, 3))  # [B, kv_heads, group, span]
    scores = scores * scaling
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(weights, value)


def use_slot_attention(model) -> bool:
    """Switch `model` to `slot_attention` where transformers lets us; False if the model has its own."""
    if not getattr(model, "_supports_attention_backend", False):
        return False
    AttentionInterface.register(SLOT_ATTENTION, slot_attention)
    AttentionMaskInterface.register(SLOT_ATTENTION, sdpa_mask)  # prompt chunks get SDPA's masks
    try:
        model.set_attn_implementation(SLOT_ATTENTION)
    except (ValueError, KeyError, ImportError) as exc:
        logger.warning("custom attention refused (%s); using the model's own", exc)
        return False
    return True


def _round_up(value: int, multiple: int) -> int:
    return max(multiple, -(-value // multiple) * multiple)

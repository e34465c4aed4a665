"""The slot KV cache (engine/backends/kv_cache.py) against the model run without any cache: rows of different
lengths, rows leaving (the last rows move into their slots) and joining mid-way, storage growing and shrinking."""
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from engine.backends import kv_cache
from engine.backends.kv_cache import SlotKVCache, slot_attention, use_slot_attention

PAGE = 16  # small pages so a short test crosses page boundaries both ways


@pytest.fixture
def model(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(kv_cache, "PAGE_TOKENS", PAGE)
    monkeypatch.setattr(kv_cache, "SHRINK_AFTER_TOKENS", 2 * PAGE)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert use_slot_attention(model)
    return model


def prompt(length: int, salt: int) -> list[int]:
    return [(7 * i + 31 * salt) % 900 + 20 for i in range(length)]


class Batch:
    """Rows decoded greedily over a SlotKVCache; every step checked against a full recompute."""

    def __init__(self, model):
        self.model = model
        config = model.config
        self.cache = SlotKVCache(config.num_hidden_layers, config.num_key_value_heads,
                                 config.hidden_size // config.num_attention_heads, torch.float32, torch.device("cpu"))
        self.sequences: list[list[int]] = []  # row i: every token fed or to be fed

    def join(self, token_ids: list[int]) -> None:
        prefill = DynamicCache()
        logits = self.model(input_ids=torch.tensor([token_ids]), past_key_values=prefill, use_cache=True).logits
        self.cache.add_row([(layer.keys, layer.values) for layer in prefill.layers], len(token_ids))
        self.sequences.append(token_ids + [int(logits[0, -1].argmax())])

    def leave(self, rows: set[int]) -> None:
        for source, target in self.cache.remove_rows(rows):
            self.sequences[target] = self.sequences[source]
        del self.sequences[len(self.sequences) - len(rows):]
        self.cache.shrink()

    def step(self, min_rows: int = 1) -> None:
        fed = [seq[-1] for seq in self.sequences]
        fed += fed[:1] * (min_rows - len(fed))
        position_ids, mask = self.cache.prepare_decode(min_rows)
        assert position_ids[:len(self.sequences), 0].tolist() == [len(seq) - 1 for seq in self.sequences]
        logits = self.model(input_ids=torch.tensor(fed)[:, None], attention_mask=mask, position_ids=position_ids,
                            past_key_values=self.cache, use_cache=True).logits[:, -1]
        self.cache.finish_decode()
        for row, seq in enumerate(self.sequences):
            expected = self.model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1]
            torch.testing.assert_close(logits[row], expected, rtol=1e-4, atol=1e-4)
            seq.append(int(logits[row].argmax()))


@torch.inference_mode()
def test_slot_decode_equals_the_model_without_cache_as_rows_join_and_leave(model):
    batch = Batch(model)
    for length, salt in ((3, 1), (20, 2), (9, 3)):
        batch.join(prompt(length, salt))
    for _ in range(6):
        batch.step()
    capacity_before = batch.cache.capacity
    batch.join(prompt(45, 4))  # longer than every slot so far: the storage grows
    assert batch.cache.capacity > capacity_before
    for _ in range(4):
        batch.step()
    batch.leave({0, 3})  # the longest row and the first: row 2 moves into slot 0
    assert batch.cache.capacity < 45  # nothing that long is left: the storage shrank
    batch.join(prompt(5, 5))
    for _ in range(PAGE + 2):  # rows cross into a new page mid-decode
        batch.step()
    batch.leave({0, 2})
    batch.step(min_rows=2)  # one row, padded to two: the padding row's output is ignored
    batch.step(min_rows=2)
    assert len(batch.sequences) == 1 and batch.cache.lengths == [len(batch.sequences[0]) - 1]


def test_leaving_rows_are_replaced_by_the_last_ones_and_their_slots_zeroed(monkeypatch):
    monkeypatch.setattr(kv_cache, "PAGE_TOKENS", PAGE)
    cache = SlotKVCache(num_layers=2, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))
    for row in range(5):
        layer = (torch.full((1, 1, 3, 2), float(row + 1)), torch.full((1, 1, 3, 2), -float(row + 1)))
        assert cache.add_row([layer, layer], length=3) == row
    moves = cache.remove_rows({1, 4})
    assert moves == [(3, 1)]  # row 4 left too: only row 3 moves
    assert cache.lengths == [3, 3, 3]
    assert [float(cache.keys[0][slot, 0, 0, 0]) for slot in range(5)] == [1.0, 4.0, 3.0, 0.0, 0.0]
    assert float(cache.values[1][1, 0, 2, 1]) == -4.0
    assert cache.remove_rows({0, 1, 2}) == [] and cache.num_rows == 0
    assert not any(t.any() for t in cache.keys + cache.values)
    assert cache.shrink() == PAGE and cache.nbytes == 0  # an empty batch keeps no storage


def test_one_query_token_attends_like_sdpa_and_ignores_masked_positions():
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 4, 1, 8, generator=generator)
    keys, values = torch.randn(3, 2, 10, 8, generator=generator), torch.randn(3, 2, 10, 8, generator=generator)
    lengths = torch.tensor([10, 4, 1])
    visible = torch.arange(10)[None, :] < lengths[:, None]
    mask = torch.zeros(3, 10).masked_fill(~visible, float("-inf"))[:, None, None, :]
    got, _ = slot_attention(None, query, keys, values, mask, scaling=8 ** -0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys.repeat_interleave(2, dim=1), values.repeat_interleave(2, dim=1), attn_mask=mask)
    torch.testing.assert_close(got, expected.transpose(1, 2))
    poisoned = values.clone()
    poisoned[1, :, 4:] = 1e30  # what a masked position holds never reaches the output
    assert torch.equal(slot_attention(None, query, keys, poisoned, mask)[0][1], got[1])


def test_no_spare_slot_past_the_kv_budget_and_the_storage_regrows_a_layer_at_a_time(monkeypatch):
    """Slots come in pairs (a row joining next needs no reallocation), but where the pair would take the storage past
    the KV budget a long row alone holds one slot: in a memory limit the spare doubled a 7,000-token row's keys and
    values (306 MB instead of 153) and the kernel killed the model worker."""
    monkeypatch.setattr(kv_cache, "PAGE_TOKENS", PAGE)

    def cache_with(budget: float) -> SlotKVCache:
        cache = SlotKVCache(num_layers=3, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                            device=torch.device("cpu"), max_positions=budget)
        row = (torch.ones((1, 1, 40, 2)), torch.ones((1, 1, 40, 2)))
        cache.add_row([row] * 3, length=40)
        return cache

    assert (cache_with(float("inf")).num_slots, cache_with(float("inf")).capacity) == (2, 48)  # the pair
    tight = cache_with(60)  # 2 x 48 positions would pass it
    assert (tight.num_slots, tight.capacity) == (1, 48)
    before = tight.reallocations
    tight.prepare_decode()  # 41 positions used of 48: no growth
    assert tight.reallocations == before
    tight.lengths[0] = 48  # the row's next token needs a new page: every layer regrown, the row's numbers kept
    tight.prepare_decode()
    assert tight.reallocations == before + 1 and (tight.num_slots, tight.capacity) == (1, 64)
    assert all(float(t[0, 0, :40].sum()) == 80.0 and float(t[0, 0, 40:].abs().sum()) == 0.0
               for t in tight.keys + tight.values)
    row = (torch.ones((1, 1, 10, 2)), torch.ones((1, 1, 10, 2)))
    assert tight.add_row([row] * 3, length=10) == 1 and tight.num_slots == 2  # a second row always gets its slot


def test_a_long_request_leaves_room_for_short_ones_beside_it(smol_model_dir):
    """The embedded model's 4-bit path keeps each row's keys and values on their own (kv_cache.RowKVCache), so the KV
    budget bounds their sum: short requests sent while a long one runs join it and end while it goes on. Padded to
    the long row (2 x 2,600 > 4,096) each would have waited for its end (docs/deployment.md measured 25 s)."""
    from engine import LLMEngine, SamplingParams
    from engine.config import EngineConfig

    engine = LLMEngine(EngineConfig(model=smol_model_dir, max_batch_kv_tokens=4096, max_batch_size=8)).start()
    try:
        assert engine.info.kv_per_row and engine.info.kv_budget_tokens == 4096
        long = engine.submit(prompt_token_ids=prompt(1600, 1), sampling=SamplingParams(max_tokens=1000,
                                                                                        ignore_eos=True))
        next(long.events())  # it decodes
        shorts = [engine.submit(prompt_token_ids=prompt(40, salt), sampling=SamplingParams(max_tokens=8,
                                                                                           ignore_eos=True))
                  for salt in range(2, 8)]  # 6 x 48 more: 2,888 in all
        assert [short.result(timeout=600).usage.completion_tokens for short in shorts] == [8] * 6
        assert engine.num_running == 1  # the long one, 1,000 tokens to go when they came
        long.cancel()
    finally:
        engine.shutdown()

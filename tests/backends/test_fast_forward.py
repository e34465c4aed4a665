"""The lean decode step (engine/backends/fast_forward.py) against the model's own forward over the same slot cache:
the same logits and the same cached keys and values, bit for bit, in bfloat16 (the embedded SmolLM2, oneDNN's
reordered weights, and a tiny random Llama), as rows join, decode and leave; prompt chunks likewise; and the
backend's step that returns a finished prompt's first token before the streams decode."""
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

from engine.backends import fast_forward
from engine.backends.fast_forward import FastDecoder, Linear
from engine.backends.hf import HFBackend
from engine.backends.kv_cache import SlotKVCache, use_slot_attention
from engine.config import EngineConfig
from engine.hardware import detect_host
from engine.messages import NewRequest, WorkerSampling


def load(model_dir: str, dtype: torch.dtype):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    assert use_slot_attention(model)
    return model


@torch.inference_mode()
def lone_rows_round_alike(model) -> bool:
    """Whether this CPU's bfloat16 matmul (oneDNN) gives a lone row the numbers it gives that row among others.
    On AVX-512 without AVX512-BF16 it does not (measured: an Intel Xeon with avx512_vnni, the lm_head's 49152 x 576
    and the down projection's 576 x 1536), while 2 rows compute as among 23: the backend never decodes a lone row
    there (hf.py pads it to 2), and a lone row's numbers (a one-token chunk's, the last row's lm_head alone) are
    compared with the model's only where lone rows round alike."""
    weights = [model.lm_head.weight, model.model.layers[0].mlp.down_proj.weight]
    x = torch.randn(23, max(w.shape[1] for w in weights), generator=torch.Generator().manual_seed(0))
    return all(torch.equal(torch.nn.functional.linear(x[-1:, :w.shape[1]].to(w.dtype), w),
                           torch.nn.functional.linear(x[:, :w.shape[1]].to(w.dtype), w)[-1:]) for w in weights)


def prompt(length: int, salt: int) -> list[int]:
    return [(13 * i + 37 * salt) % 5000 + 20 for i in range(length)]


class TwinBatches:
    """The same rows decoded by the model's forward (on `reference`) and by FastDecoder (on its own copy of the
    model), each over its own SlotKVCache; every step compares the two."""

    def __init__(self, reference, fast_model):
        self.reference, self.fast = reference, FastDecoder(fast_model)
        config = reference.config
        shape = (config.num_hidden_layers, config.num_key_value_heads, config.hidden_size // config.num_attention_heads,
                 reference.dtype, torch.device("cpu"))
        self.reference_cache, self.fast_cache = SlotKVCache(*shape), SlotKVCache(*shape)
        self.last_tokens: list[int] = []

    def join(self, token_ids: list[int]) -> None:
        prefill = DynamicCache()
        logits = self.reference(input_ids=torch.tensor([token_ids]), past_key_values=prefill, use_cache=True).logits
        layers = [(layer.keys, layer.values) for layer in prefill.layers]
        self.reference_cache.add_row(layers, len(token_ids))
        self.fast_cache.add_row(layers, len(token_ids))
        self.last_tokens.append(int(logits[0, -1].argmax()))

    def leave(self, rows: set[int]) -> None:
        moves = self.reference_cache.remove_rows(rows)
        assert self.fast_cache.remove_rows(rows) == moves
        for source, target in moves:
            self.last_tokens[target] = self.last_tokens[source]
        del self.last_tokens[len(self.last_tokens) - len(rows):]

    def step(self, min_rows: int) -> None:
        fed = self.last_tokens + self.last_tokens[:1] * (min_rows - len(self.last_tokens))
        input_ids = torch.tensor(fed)[:, None]
        position_ids, mask = self.reference_cache.prepare_decode(min_rows)
        expected = self.reference(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                                  past_key_values=self.reference_cache, use_cache=True).logits[:, -1]
        position_ids, mask = self.fast_cache.prepare_decode(min_rows)
        got = self.fast.decode(input_ids, position_ids, mask, self.fast_cache)
        self.reference_cache.finish_decode()
        self.fast_cache.finish_decode()
        rows = len(self.last_tokens)
        assert torch.equal(got[:rows], expected[:rows])
        for stored, reference in zip(self.fast_cache.keys + self.fast_cache.values,
                                     self.reference_cache.keys + self.reference_cache.values):
            assert torch.equal(stored[:rows], reference[:rows])
        self.last_tokens = got[:rows].argmax(-1).tolist()


@pytest.mark.parametrize("which", ["smollm2", "tiny-llama"])
@torch.inference_mode()
def test_the_fast_step_gives_the_models_logits_and_cache_bit_for_bit(which, smol_model_dir, tiny_model_dir):
    model_dir = smol_model_dir if which == "smollm2" else tiny_model_dir
    batches = TwinBatches(load(model_dir, torch.bfloat16), load(model_dir, torch.bfloat16))
    for salt, length in enumerate((5, 23, 11)):
        batches.join(prompt(length, salt))
    for _ in range(3):
        batches.step(min_rows=2)
    batches.leave({0})  # the last row moves into slot 0
    batches.join(prompt(40, 7))
    for _ in range(3):
        batches.step(min_rows=2)
    batches.leave({0, 1})
    for _ in range(2):
        batches.step(min_rows=2)  # one real row beside a padding row, as batch invariance runs it
    if lone_rows_round_alike(batches.reference):
        batches.step(min_rows=1)


@pytest.mark.parametrize("which", ["smollm2", "tiny-llama"])
@torch.inference_mode()
def test_a_prompt_fed_in_chunks_gets_the_models_logits_and_cache_bit_for_bit(which, smol_model_dir, tiny_model_dir):
    model_dir = smol_model_dir if which == "smollm2" else tiny_model_dir
    reference, fast_model = load(model_dir, torch.bfloat16), load(model_dir, torch.bfloat16)
    fast = FastDecoder(fast_model)
    token_ids = prompt(300, 3)
    reference_cache, fast_cache = DynamicCache(), DynamicCache()
    lone_rows_alike = lone_rows_round_alike(reference)  # else no one-token chunk, and the last row's own lm_head
    chunks = ((0, 23), (23, 40), (40, 41), (41, 300)) if lone_rows_alike else ((0, 23), (23, 40), (40, 300))
    for start, end in chunks:
        expected = reference(input_ids=torch.tensor([token_ids[start:end]]),
                             position_ids=torch.arange(start, end)[None], attention_mask=torch.ones(1, end),
                             past_key_values=reference_cache, use_cache=True).logits[0]
        got = fast.prefill(torch.tensor(token_ids[start:end]), start, fast_cache, all_positions=True)
        assert torch.equal(got, expected)
        alone = DynamicCache() if start == 0 else _copy(reference_cache, start)
        last = fast.prefill(torch.tensor(token_ids[start:end]), start, alone)  # the lm_head of the last row alone
        assert torch.equal(last, expected[-1]) or not lone_rows_alike
        for mine, theirs in zip(fast_cache.layers, reference_cache.layers):
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def _copy(cache: DynamicCache, length: int) -> DynamicCache:
    """The first `length` positions of `cache`, as a new cache."""
    copied = DynamicCache()
    for index, layer in enumerate(cache.layers):
        copied.update(layer.keys[:, :, :length].clone(), layer.values[:, :, :length].clone(), index)
    return copied


@torch.inference_mode()
def test_the_model_reads_the_fused_weights_it_was_given(tiny_model_dir):
    """Fusing makes q/k/v and gate/up views of one weight: the model's forward (prefill) must compute what it did."""
    model = load(tiny_model_dir, torch.bfloat16)
    input_ids = torch.tensor([prompt(9, 1)])
    before = model(input_ids=input_ids).logits
    FastDecoder(model)
    attention = model.model.layers[0].self_attn
    assert attention.k_proj.weight.untyped_storage().data_ptr() == attention.q_proj.weight.untyped_storage().data_ptr()
    assert torch.equal(model(input_ids=input_ids).logits, before)


@torch.inference_mode()
def test_reordered_weights_compute_what_the_plain_matmul_does(smol_model_dir):
    model = load(smol_model_dir, torch.bfloat16)
    layer = model.model.layers[0]
    weights = [layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight, model.lm_head.weight]
    for weight in weights:
        linear = Linear(weight)
        if torch.backends.mkldnn.is_available() and detect_host().has_native_bf16:
            assert linear.packed is not None  # where bfloat16 is emulated, oneDNN's reorder may compute otherwise
        x = torch.randn(17, weight.shape[1], generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        for rows in (1, 2, 5, 17):
            assert torch.equal(linear(x[:rows]), torch.nn.functional.linear(x[:rows], weight))


@torch.inference_mode()
def test_a_reordered_matmul_that_computes_differently_is_not_used(monkeypatch, smol_model_dir):
    weight = load(smol_model_dir, torch.bfloat16).model.layers[0].mlp.down_proj.weight
    real = torch.ops.mkldnn._linear_pointwise

    def off_by_one(x, *args):
        return real(x, *args) + 1

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", off_by_one)
    linear = Linear(weight)
    assert linear.packed is None
    x = torch.randn(3, weight.shape[1]).to(torch.bfloat16)
    assert torch.equal(linear(x), torch.nn.functional.linear(x, weight))


def test_models_it_does_not_understand_keep_their_own_forward():
    tiny = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1)
    assert FastDecoder.supports(LlamaForCausalLM(LlamaConfig(**tiny)).to(torch.bfloat16))
    assert not FastDecoder.supports(LlamaForCausalLM(LlamaConfig(**tiny)))  # float32: MKL, see the module's docstring
    assert not FastDecoder.supports(LlamaForCausalLM(LlamaConfig(**tiny, attention_bias=True)).to(torch.bfloat16))
    assert not FastDecoder.supports(LlamaForCausalLM(LlamaConfig(**tiny, hidden_act="gelu")).to(torch.bfloat16))
    assert fast_forward.SUPPORTED_MODEL_TYPES >= {"llama"}


@torch.inference_mode()
def test_a_finished_prompt_returns_its_first_token_before_the_streams_decode(smol_model_dir):
    """TTFT beside streams: the step that finishes a prompt returns its first token without a decode of the running
    rows; the next step decodes everyone; two such steps in a row never leave the streams waiting twice."""
    # Both first prompts in the first step however long each takes: a step keeps to a time target, and on a host
    # where bfloat16 is emulated (AVX2) one 12-token prompt outlasts the target beside another
    config = EngineConfig(model=smol_model_dir, dtype="bfloat16", device="cpu", threads=1, prefill_step_target_s=600)
    backend = HFBackend(config, smol_model_dir)
    assert backend.fast_decoder is not None

    def request(name: str, salt: int) -> NewRequest:
        return NewRequest(name, tuple(prompt(12, salt)), WorkerSampling(max_tokens=50))

    assert set(backend.step((request("a", 1), request("b", 2)), ()).new_token_ids) == {"a", "b"}
    assert set(backend.step((), ()).new_token_ids) == {"a", "b"}
    assert set(backend.step((request("c", 3),), ()).new_token_ids) == {"c"}  # the streams wait one round-trip
    assert set(backend.step((request("d", 4),), ()).new_token_ids) == {"a", "b", "c", "d"}  # never twice
    assert set(backend.step((request("e", 5),), ()).new_token_ids) == {"e"}
    assert set(backend.step((), ()).new_token_ids) == {"a", "b", "c", "d", "e"}
    backend.close()


@torch.inference_mode()
def test_the_backend_gives_the_same_tokens_with_the_models_own_forward(smol_model_dir):
    """LOCKSTEP_FAST_DECODE=false: the model's forward decodes; every greedy token is the same as the fast
    forward's with oneDNN's matmuls (lockstep's own kernels round differently: tests/backends/test_bf16_kernels.py)."""
    requests = tuple(NewRequest(f"r{i}", tuple(prompt(8 + 9 * i, i)), WorkerSampling(max_tokens=20)) for i in range(3))

    def tokens(fast_decode: bool) -> dict[str, list[int]]:
        # the three prompts fed in the first step on both paths, however long each takes (a step keeps to a time
        # target): the model's own forward attends over the whole padded capacity, whose length changes its sums
        config = EngineConfig(model=smol_model_dir, dtype="bfloat16", device="cpu", threads=1, fast_decode=fast_decode,
                              bf16_kernel=False, prefill_step_target_s=600)
        backend = HFBackend(config, smol_model_dir)
        assert (backend.fast_decoder is not None) == fast_decode
        got: dict[str, list[int]] = {}
        for step in range(22):
            for request_id, token_ids in backend.step(requests if step == 0 else (), ()).new_token_ids.items():
                got.setdefault(request_id, []).extend(token_ids)
        backend.close()
        return got

    fast = tokens(True)
    assert all(len(fast[r.request_id]) >= 20 for r in requests)  # the parent, not the backend, ends a request
    assert fast == tokens(False)


def test_the_rotary_table_is_the_correctly_rounded_cos_and_sin_of_the_modules_angles(smol_model_dir):
    """The 4-bit path looks its rotary tables up per step instead of computing them: the module's angles, their
    cos and sin correctly rounded (so the same numbers in every process, and within float32's epsilon of the
    module's own), for any positions in any order and number, past the table's first size too (it grows)."""
    import math

    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    module = LlamaRotaryEmbedding(config=AutoConfig.from_pretrained(smol_model_dir))
    table = fast_forward.RotaryTable(module)
    generator = torch.Generator().manual_seed(0)
    for positions in (torch.tensor([0]), torch.tensor([5, 3, 900, 7]), torch.arange(60, 160),
                      torch.randint(0, 5000, (33,), generator=generator), torch.tensor([8191, 0])):
        cos, sin = table(positions)
        expected_cos, expected_sin = module(torch.empty((1, len(positions), 1)), positions[None])
        assert cos.is_contiguous() and cos.shape == (len(positions), expected_cos.shape[-1])
        ulp = torch.finfo(torch.float32).eps
        assert (cos - expected_cos[0]).abs().max() <= ulp and (sin - expected_sin[0]).abs().max() <= ulp
        angles = positions[:, None].float() * torch.cat([module.inv_freq, module.inv_freq]).float()
        for cos_row, sin_row, row_angles in zip(cos.tolist(), sin.tolist(), angles.tolist()):
            assert cos_row == [float(torch.tensor(math.cos(a), dtype=torch.float32)) for a in row_angles]
            assert sin_row == [float(torch.tensor(math.sin(a), dtype=torch.float32)) for a in row_angles]
    assert len(table.cos) >= 8192

"""lockstep's bfloat16 kernels (engine/backends/bf16_kernels.c, bf16.py: the weight matmul, the decode attention,
RMSNorm): built with the machine's compiler; within bfloat16's rounding of the exact result on the model's own
weights and on generated shapes; each row the same alone as in any batch; the fast forward on them as accurate as on
oneDNN's matmul; and every way they can be unavailable falls back to oneDNN."""
import dataclasses
import logging
import multiprocessing
import os
import subprocess
import sys
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from engine.backends import bf16
from engine.backends.fast_forward import FastDecoder
from engine.backends.hf import HFBackend
from engine.backends.kv_cache import SlotKVCache, one_query_attention, use_slot_attention
from engine.config import EngineConfig, default_cache_dir

PROMPTS = ["The capital of France is", "Write a short paragraph about the ocean. The ocean is",
           "def fibonacci(n):\n    ", "Once upon a time, in a land far away, there lived a"]


MISSING_INSTRUCTIONS = sorted(bf16.CPU_FLAGS - bf16._cpu_flags())
# The kernels' own instructions: where the CPU lacks them, their tests are skipped (and the 4-bit kernels'
# dispatch test, tests/backends/test_q4_kernels.py, shows which path this host runs instead).
needs_avx512_bf16 = pytest.mark.skipif(bool(MISSING_INSTRUCTIONS),
                                       reason=f"this CPU lacks {', '.join(MISSING_INSTRUCTIONS)}")


@pytest.fixture(scope="module")
def kernels():
    if MISSING_INSTRUCTIONS:
        pytest.skip(f"this CPU lacks {', '.join(MISSING_INSTRUCTIONS)}")
    loaded = bf16.load_bf16_kernels(default_cache_dir())
    assert loaded is not None, "this machine (AVX512-BF16, a C compiler) should run the kernels; see the log"
    return loaded


def load(model_dir: str, dtype: torch.dtype):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    assert use_slot_attention(model)
    return model


def exact_bound(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product, and how far a float32-accumulated, bfloat16-rounded result may be from it."""
    exact = x.double() @ weight.double().T
    return exact, exact.abs() * 2 ** -8 + (x.double().abs() @ weight.double().abs().T) * 2 ** -20


@torch.inference_mode()
def test_every_weight_shape_of_the_model_within_bfloat16_rounding_and_each_row_alone_as_in_a_batch(
        kernels, smol_model_dir):
    model = load(smol_model_dir, torch.bfloat16)
    layer = model.model.layers[3]
    weights = {"q": layer.self_attn.q_proj.weight, "k": layer.self_attn.k_proj.weight,
               "gate": layer.mlp.gate_proj.weight, "down": layer.mlp.down_proj.weight,
               "lm_head": model.lm_head.weight[:4096]}
    generator = torch.Generator().manual_seed(1)
    for name, weight in weights.items():
        packed = kernels.pack(weight)
        x = torch.randn(40, weight.shape[1], generator=generator).to(torch.bfloat16)
        together = kernels.linear(x, packed)
        exact, bound = exact_bound(x, weight)
        assert ((together.double() - exact).abs() <= bound).all(), name
        for rows in (1, 2, 7, 8, 9, 17, 33):  # inside one pass of 8 rows, across passes, a ragged last pass
            assert torch.equal(kernels.linear(x[:rows], packed), together[:rows]), (name, rows)
        assert torch.equal(kernels.linear(x[5:6], packed), together[5:6]), name


GENERATED = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@GENERATED
@given(rows=st.integers(1, 20), blocks=st.integers(1, 3), depth=st.integers(1, 160).map(lambda half: 2 * half),
       seed=st.integers(0, 2 ** 16))
def test_generated_matmul_shapes_within_rounding_and_row_by_row(kernels, rows, blocks, depth, seed):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(32 * blocks, depth, generator=generator).to(torch.bfloat16)
    x = torch.randn(rows, depth, generator=generator).to(torch.bfloat16)
    packed = kernels.pack(weight)
    together = kernels.linear(x, packed)
    exact, bound = exact_bound(x, weight)
    assert ((together.double() - exact).abs() <= bound).all()
    assert torch.equal(kernels.linear(x[-1:], packed), together[-1:])


def exact_attention(query, keys, values, length: int, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's float64 attention over positions 0..length-1, and its bound: the softmax weights rounded to
    bfloat16 (as the torch path rounds them), then the result."""
    num_kv_heads, head_dim = keys.shape[0], keys.shape[2]
    grouped = query.double().view(num_kv_heads, -1, head_dim)
    weights = torch.softmax(grouped @ keys[:, :length].double().transpose(1, 2) * scaling, dim=-1)
    row_values = values[:, :length].double()
    exact = (weights @ row_values).reshape(-1, head_dim)
    bound = (weights @ row_values.abs()).reshape(-1, head_dim) * 2 ** -7 + exact.abs() * 2 ** -8 + 1e-6
    return exact, bound


@GENERATED
@given(lengths=st.lists(st.integers(1, 150), min_size=1, max_size=6), num_kv_heads=st.integers(1, 3),
       group=st.integers(1, 8), head_dim=st.sampled_from([32, 64, 96, 128]), spare=st.integers(0, 40),
       seed=st.integers(0, 2 ** 16))
def test_generated_decode_attention_within_rounding_and_row_by_row(kernels, lengths, num_kv_heads, group, head_dim,
                                                                     spare, seed):
    """Any row count, length up to the slot's end (including exactly its capacity), odd and even lengths, the
    specialised head sizes (64, 128) and the general one."""
    generator = torch.Generator().manual_seed(seed)
    rows, capacity = len(lengths), max(lengths) + spare
    query = torch.randn(rows, num_kv_heads * group, head_dim, generator=generator).to(torch.bfloat16)
    keys, values = (torch.randn(rows + 1, num_kv_heads, capacity, head_dim, generator=generator).to(torch.bfloat16)
                    for _ in range(2))  # one slot more than rows: never read
    lengths_tensor = torch.tensor(lengths)
    scaling = head_dim ** -0.5
    together = kernels.decode_attention(query, keys, values, lengths_tensor, scaling)
    for row, length in enumerate(lengths):
        exact, bound = exact_attention(query[row], keys[row], values[row], length, scaling)
        assert ((together[row].double() - exact).abs() <= bound).all(), (row, length)
    last = rows - 1
    alone = kernels.decode_attention(query[last:].contiguous(), keys[last:last + 1].contiguous(),
                                    values[last:last + 1].contiguous(), lengths_tensor[last:], scaling)
    assert torch.equal(alone[0], together[last])


@torch.inference_mode()
def test_decode_attention_on_the_slot_cache_agrees_with_the_torch_path(kernels):
    """The way the fast forward calls it: the slot cache's rows and its step positions, against
    kv_cache.one_query_attention with the cache's own mask."""
    generator = torch.Generator().manual_seed(3)
    cache = SlotKVCache(1, 3, 64, torch.bfloat16, torch.device("cpu"))
    for length in (5, 64, 65, 130):
        layer = [tuple(torch.randn(1, 3, length, 64, generator=generator).to(torch.bfloat16) for _ in range(2))]
        cache.add_row(layer, length)
    position_ids, mask = cache.prepare_decode()
    fed = [torch.randn(4, 3, 1, 64, generator=generator).to(torch.bfloat16) for _ in range(2)]
    keys, values = cache.update(*fed, 0)
    query = torch.randn(4, 9, 64, generator=generator).to(torch.bfloat16)
    got = kernels.decode_attention(query, keys, values, position_ids[:, 0] + 1, 0.125)
    expected = one_query_attention(query, keys, values, mask, 0.125).view(4, 9, 64)
    assert ((got.float() - expected.float()).abs() <= expected.float().abs() * 2 ** -6 + 2e-2).all()


@GENERATED
@given(rows=st.integers(1, 9), hidden=st.integers(1, 70).map(lambda n: 8 * n),
       scale=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 2 ** 16))
def test_generated_rms_norms_match_transformers_within_one_rounding(kernels, rows, hidden, scale, seed):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=generator) * scale).to(torch.bfloat16)
    weight = torch.randn(hidden, generator=generator).to(torch.bfloat16)
    got = kernels.rms_norm(x, weight, 1e-5)
    as_transformers = weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    ulp = as_transformers.float().abs() * 2 ** -7 + 1e-30
    assert ((got.float() - as_transformers.float()).abs() <= ulp).all()
    assert torch.equal(kernels.rms_norm(x[-1], weight, 1e-5), got[-1])


def test_it_refuses_inputs_it_cannot_read(kernels):
    packed = kernels.pack(torch.ones(64, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16"):
        kernels.linear(torch.ones(2, 16), packed)
    with pytest.raises(ValueError, match="16 features"):  # would reshape into rows of the wrong length
        kernels.linear(torch.ones(2, 24, dtype=torch.bfloat16), packed)
    assert not kernels.supports(torch.ones(48, 16, dtype=torch.bfloat16))  # columns not a multiple of 32
    assert not kernels.supports(torch.ones(64, 15, dtype=torch.bfloat16))  # odd depth
    assert not kernels.supports(torch.ones(64, 16))  # float32
    query, slots = torch.ones(2, 6, 64, dtype=torch.bfloat16), torch.ones(2, 2, 16, 64, dtype=torch.bfloat16)
    for lengths in ([0, 3], [3, 17], [3]):  # a row with nothing to attend to, past its slot, a row without length
        with pytest.raises(ValueError):
            kernels.decode_attention(query, slots, slots, torch.tensor(lengths), 0.125)
    with pytest.raises(ValueError):  # more rows than slots
        kernels.decode_attention(torch.ones(3, 6, 64, dtype=torch.bfloat16), slots, slots, torch.tensor([1, 1, 1]), 1.0)
    with pytest.raises(ValueError):  # a strided view
        kernels.decode_attention(query, slots[:, :, ::2], slots[:, :, ::2], torch.tensor([1, 1]), 1.0)
    with pytest.raises(ValueError):
        kernels.rms_norm(torch.ones(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError, match="8 features"):
        kernels.rms_norm(torch.ones(2, 16, dtype=torch.bfloat16), torch.ones(8, dtype=torch.bfloat16), 1e-5)


@torch.inference_mode()
def test_the_fast_forward_on_the_kernels_is_as_accurate_as_on_onednn(kernels, smol_model_dir):
    """Against the float32 model: the same top token, and logits about as far off as oneDNN's bfloat16 ones."""
    tokenizer = AutoTokenizer.from_pretrained(smol_model_dir)
    reference = load(smol_model_dir, torch.float32)
    on_kernels = FastDecoder(load(smol_model_dir, torch.bfloat16), kernels)
    on_onednn = FastDecoder(load(smol_model_dir, torch.bfloat16))
    assert on_kernels.kernels is kernels and on_onednn.kernels is None
    for text in PROMPTS:
        token_ids = torch.tensor(tokenizer(text)["input_ids"])
        exact = reference(token_ids[None]).logits[0, -1]
        errors = {}
        for name, decoder in (("kernels", on_kernels), ("onednn", on_onednn)):
            logits = decoder.prefill(token_ids, 0, DynamicCache(config=reference.config)).float()
            assert int(logits.argmax()) == int(exact.argmax()), (name, text)
            errors[name] = float((logits - exact).abs().max())
        assert errors["kernels"] < 2 * errors["onednn"] + 0.25, (text, errors)


@needs_avx512_bf16
@torch.inference_mode()
def test_the_backend_decodes_on_the_kernels_by_default_here(smol_model_dir):
    threads = torch.get_num_threads()
    backend = HFBackend(EngineConfig(model=smol_model_dir, dtype="bfloat16", device="cpu", threads=1),
                        smol_model_dir)
    assert backend.fast_decoder is not None and backend.fast_decoder.kernels is not None
    assert all(layer.qkv.kernels is not None for layer in backend.fast_decoder.layers)
    assert backend.fast_decoder.rows_independent  # so a lone row decodes alone (test_batch_invariance checks it)
    assert backend.fast_decoder.stack is not None and backend.fast_decoder.share_matmuls_rows == 16
    backend.close()
    with_two_threads = HFBackend(EngineConfig(model=smol_model_dir, dtype="bfloat16", device="cpu", threads=2),
                                 smol_model_dir)
    assert with_two_threads.fast_decoder.kernels is None  # a one-core kernels: oneDNN spreads over the threads
    with_two_threads.close()
    torch.set_num_threads(threads)


@needs_avx512_bf16
def test_kernels_that_compute_wrong_numbers_are_not_used(monkeypatch, caplog, smol_model_dir):
    monkeypatch.setattr(bf16.Bf16Kernels, "computes_correctly", lambda self: False)
    with caplog.at_level(logging.WARNING, logger="engine.backends.bf16"):
        assert bf16.load_bf16_kernels(default_cache_dir()) is None
    assert "wrong numbers" in caplog.text
    backend = HFBackend(EngineConfig(model=smol_model_dir, dtype="bfloat16", device="cpu", threads=1),
                        smol_model_dir)
    assert backend.fast_decoder is not None and backend.fast_decoder.kernels is None
    backend.close()


def test_no_kernels_without_the_cpu_instructions_or_a_working_compiler(monkeypatch, caplog, tmp_path):
    with caplog.at_level(logging.INFO, logger="engine.backends.bf16"):
        monkeypatch.setattr(bf16, "_cpu_flags", lambda: {"avx2", "avx512f"})
        assert bf16.load_bf16_kernels(str(tmp_path)) is None
        assert "lacks avx512_bf16, avx512bw, avx512vl" in caplog.text
        monkeypatch.setattr(bf16, "_cpu_flags", lambda: set(bf16.CPU_FLAGS))  # as if it had them, to build
        monkeypatch.setenv("CC", "false")  # a compiler that fails
        assert bf16.load_bf16_kernels(str(tmp_path)) is None
        assert "could not build" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built left to load later


@needs_avx512_bf16
def test_processes_that_build_it_at_once_all_load_it(tmp_path):
    """gunicorn workers and test processes may start together on an empty cache folder."""
    script = ("import sys; from engine.backends import bf16; "
              "sys.exit(0 if bf16.load_bf16_kernels(sys.argv[1]) is not None else 1)")
    builders = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)]) for _ in range(4)]
    assert [builder.wait(timeout=180) for builder in builders] == [0, 0, 0, 0]
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1
    assert not [path for path in (tmp_path / "kernels").iterdir() if path.is_dir()]  # no build folders left


def test_packed_weights_sit_on_huge_pages_where_linux_offers_them(kernels):
    """A decode step streams every packed weight; through 4 KB pages the core reads them more slowly."""
    mode = open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="utf-8").read()
    packed = kernels.pack(torch.ones(32 * 2048, 1024, dtype=torch.bfloat16))  # 128 MB
    assert packed.data_ptr() % 64 == 0 and packed.is_contiguous()
    assert torch.equal(kernels.linear(torch.ones(1, 1024, dtype=torch.bfloat16), packed),
                       torch.full((1, 32 * 2048), 1024.0, dtype=torch.bfloat16))
    if "[never]" in mode:
        return
    assert mapping_huge_page_kb(packed.data_ptr()) >= 64 * 1024


def mapping_huge_page_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps", encoding="utf-8") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields[0].split("-")) == 2 and not fields[0].endswith(":"):
                start, end = (int(part, 16) for part in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "AnonHugePages:":
                return int(fields[1])
    return 0


def prefilled_slots(decoder: FastDecoder, config, prompts: list[list[int]]) -> tuple[SlotKVCache, torch.Tensor]:
    """A slot cache holding `prompts` (prefilled one by one), and each row's first token."""
    cache = SlotKVCache(config.num_hidden_layers, config.num_key_value_heads, decoder.head_dim, torch.bfloat16,
                        torch.device("cpu"))
    first_tokens = []
    for prompt in prompts:
        prompt_cache = DynamicCache(config=config)
        logits = decoder.prefill(torch.tensor(prompt), 0, prompt_cache)
        cache.add_row([(layer.keys, layer.values) for layer in prompt_cache.layers], len(prompt))
        first_tokens.append(int(logits.argmax()))
    return cache, torch.tensor(first_tokens)


@torch.inference_mode()
def test_a_decode_step_in_one_call_gives_the_layer_by_layer_numbers(kernels, smol_model_dir):
    """bf16_kernels.c's decode step (every layer, the final norm and the lm_head in one call, alone or with its
    helper thread) against fast_forward's layer-by-layer Python on the same kernels: the same logits and the same
    keys and values, bit for bit, for 1 to 12 rows whose lengths cross a page of the slot cache."""
    model = load(smol_model_dir, torch.bfloat16)
    decoders = {"layer by layer": FastDecoder(model, kernels, whole_step_in_c=False),
                "one call": FastDecoder(model, kernels),
                "one call with the helper": FastDecoder(model, kernels, share_matmuls_rows=16)}
    assert decoders["layer by layer"].stack is None and decoders["one call"].stack is not None
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 49152, (length,), generator=generator).tolist()
               for length in (60, 5, 63, 17, 1, 33, 58, 2, 40, 61, 9, 64)]
    for rows in (1, 3, 12):
        runs = {}
        for mode, decoder in decoders.items():
            cache, tokens = prefilled_slots(decoder, model.config, prompts[:rows])
            logits = []
            for _ in range(6):  # rows of 60-64 tokens grow past the first page of 64 positions
                position_ids, mask = cache.prepare_decode()
                logits.append(decoder.decode(tokens[:, None], position_ids, mask, cache))
                cache.finish_decode()
                tokens = logits[-1].argmax(-1)
            runs[mode] = logits, cache
        expected_logits, expected_cache = runs["layer by layer"]
        for mode, (logits, cache) in runs.items():
            assert all(torch.equal(got, expected) for got, expected in zip(logits, expected_logits)), (rows, mode)
            stored, expected_stored = cache.keys + cache.values, expected_cache.keys + expected_cache.values
            assert all(torch.equal(got, expected) for got, expected in zip(stored, expected_stored)), (rows, mode)


def tiny_stack(kernels, generator: torch.Generator) -> bf16.DecoderStack:
    """Two random layers: hidden 64, 2 query heads and 1 KV head of 32, intermediate 96, vocabulary 128."""
    def weight(*shape):
        return (torch.randn(*shape, generator=generator) * 0.2).to(torch.bfloat16)
    layers = [bf16.LayerWeights(weight(64) + 1, 1e-5, kernels.pack(weight(128, 64)), kernels.pack(weight(64, 64)),
                                  weight(64) + 1, 1e-6, kernels.pack(weight(192, 64)), kernels.pack(weight(64, 96)))
              for _ in range(2)]
    return bf16.DecoderStack(kernels, layers, weight(64) + 1, 1e-5, kernels.pack(weight(128, 64)), 2, 1, 32)


def tiny_step(kernels, stack, share: bool, rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(rows, 64, generator=generator).to(torch.bfloat16)
    keys = [torch.randn(4, 1, 64, 32, generator=generator).to(torch.bfloat16) for _ in range(2)]
    values = [torch.randn(4, 1, 64, 32, generator=generator).to(torch.bfloat16) for _ in range(2)]
    angles = torch.randn(rows, 32, generator=generator)
    logits = kernels.decode_step(stack, hidden, torch.tensor([63, 0, 30, 7][:rows]), angles.cos().to(torch.bfloat16),
                                 angles.sin().to(torch.bfloat16), keys, values, share_matmuls=share)
    return logits, torch.stack(keys + values)


def _step_in_child(kernels, stack, results, one_cpu: bool) -> None:
    if one_cpu:  # the caller and its helper (made after this, so it inherits it) on one CPU: they preempt each other
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    results.put([[tensor.tolist() for tensor in tiny_step(kernels, stack, share=True)] for _ in range(30)])


def test_the_helper_thread_survives_a_fork_and_a_second_caller(kernels):
    """The model worker is forked from a process that may have used the helper (the child has its memory, not
    its thread); the helper may be off its core whenever the kernel likes (here: one CPU for both threads); and
    ctypes lets two Python threads into the kernels at once. Every step still ends, with the same numbers."""
    stack = tiny_stack(kernels, torch.Generator().manual_seed(2))
    expected = tiny_step(kernels, stack, share=False)
    assert all(torch.equal(got, want) for got, want in zip(tiny_step(kernels, stack, share=True), expected))
    context = multiprocessing.get_context("fork")
    for one_cpu in (False, True):
        results = context.Queue()
        child = context.Process(target=_step_in_child, args=(kernels, stack, results, one_cpu))
        child.start()
        from_child = results.get(timeout=120)
        child.join(timeout=60)
        assert child.exitcode == 0
        assert all(torch.equal(torch.tensor(got, dtype=torch.bfloat16), want)
                   for step in from_child for got, want in zip(step, expected)), one_cpu
    outcomes = []

    def caller():
        outcomes.extend(all(torch.equal(got, want) for got, want in zip(tiny_step(kernels, stack, share=True),
                                                                        expected)) for _ in range(200))
    threads = [threading.Thread(target=caller) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert outcomes == [True] * 400


def test_the_decode_step_refuses_what_it_cannot_read(kernels):
    generator = torch.Generator().manual_seed(3)
    stack = tiny_stack(kernels, generator)
    hidden, cos = torch.ones(2, 64, dtype=torch.bfloat16), torch.ones(2, 32, dtype=torch.bfloat16)
    slots = [torch.zeros(2, 1, 16, 32, dtype=torch.bfloat16) for _ in range(2)]
    kernels.decode_step(stack, hidden.clone(), torch.tensor([15, 0]), cos, cos, slots, slots)  # fits
    for positions in ([16, 0], [-1, 0], [0]):  # past the slot, before it, a row without one
        with pytest.raises(ValueError, match="position"):
            kernels.decode_step(stack, hidden.clone(), torch.tensor(positions), cos, cos, slots, slots)
    with pytest.raises(ValueError, match="slot caches"):  # more rows than slots
        kernels.decode_step(stack, torch.ones(3, 64, dtype=torch.bfloat16), torch.tensor([0, 0, 0]),
                            torch.ones(3, 32, dtype=torch.bfloat16), torch.ones(3, 32, dtype=torch.bfloat16), slots,
                            slots)
    with pytest.raises(ValueError, match="one contiguous"):  # a layer's cache missing, a strided one
        kernels.decode_step(stack, hidden.clone(), torch.tensor([0, 0]), cos, cos, slots[:1], slots)
    with pytest.raises(ValueError, match="one contiguous"):
        kernels.decode_step(stack, hidden.clone(), torch.tensor([0, 0]), cos, cos, slots,
                            [slot[:, :, ::2] for slot in slots])
    with pytest.raises(ValueError, match="rotary"):
        kernels.decode_step(stack, hidden.clone(), torch.tensor([0, 0]), cos[:, :16], cos[:, :16], slots, slots)

    def packed(rows, depth):
        return kernels.pack(torch.ones(rows, depth, dtype=torch.bfloat16))
    norm = torch.ones(64, dtype=torch.bfloat16)
    layer = bf16.LayerWeights(norm, 1e-5, packed(96, 64), packed(64, 64), norm, 1e-5, packed(192, 64), packed(64, 96))
    with pytest.raises(ValueError, match="shapes"):  # q/k/v of 96 rows where 2 + 2 x 1 heads of 32 need 128
        bf16.DecoderStack(kernels, [layer], norm, 1e-5, packed(128, 64), 2, 1, 32)
    fitting = dataclasses.replace(layer, qkv=packed(128, 64))
    bf16.DecoderStack(kernels, [fitting], norm, 1e-5, packed(128, 64), 2, 1, 32)
    with pytest.raises(ValueError, match="shapes"):  # an lm_head not packed for the kernels
        bf16.DecoderStack(kernels, [fitting], norm, 1e-5, torch.ones(128, 64, dtype=torch.bfloat16), 2, 1, 32)


def test_swiglu_matches_torch_within_one_rounding(kernels):
    """silu(gate) * up as the decode step computes it, against torch's bfloat16 ops: the kernels' exp differs
    from torch's in float32's last bits, so a rare value rounds to the neighbouring bfloat16."""
    generator = torch.Generator().manual_seed(4)
    gate_up = (torch.randn(7, 2 * 1536, generator=generator)
               * torch.tensor([1e-3, 1.0, 8.0, 100.0]).repeat_interleave(2 * 1536 // 4)).to(torch.bfloat16)
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])
    got = kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    assert ((got.float() - expected.float()).abs() <= expected.float().abs() * 2 ** -7).all()
    assert (got == expected).float().mean() > 0.99
    assert torch.equal(kernels.silu_mul(gate_up[3]), got[3])

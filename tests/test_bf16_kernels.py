"""lockstep's bfloat16 kernels (engine/backends/bf16_kernels.c, native.py: the weight matmul, the decode attention,
RMSNorm): built with the machine's compiler; within bfloat16's rounding of the exact result on the model's own
weights and on generated shapes; each row the same alone as in any batch; the fast forward on them as accurate as on
oneDNN's matmul; and every way they can be unavailable falls back to oneDNN."""
import logging
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from engine.backends import native
from engine.backends.fast_decode import FastDecoder
from engine.backends.hf import HFBackend
from engine.backends.kv_cache import SlotKVCache, one_query_attention, use_slot_attention
from engine.config import EngineConfig, default_cache_dir

PROMPTS = ["The capital of France is", "Write a short paragraph about the ocean. The ocean is",
           "def fibonacci(n):\n    ", "Once upon a time, in a land far away, there lived a"]


@pytest.fixture(scope="module")
def kernels():
    loaded = native.load_bf16_kernels(default_cache_dir())
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


@torch.inference_mode()
def test_the_backend_decodes_on_the_kernels_by_default_here(smol_model_dir):
    threads = torch.get_num_threads()
    backend = HFBackend(EngineConfig(model=smol_model_dir, dtype="bfloat16", device="cpu", threads=1),
                        smol_model_dir)
    assert backend.fast_decoder is not None and backend.fast_decoder.kernels is not None
    assert all(layer.qkv.kernels is not None for layer in backend.fast_decoder.layers)
    assert backend.fast_decoder.rows_independent  # so a lone row decodes alone (test_batch_invariance checks it)
    backend.close()
    with_two_threads = HFBackend(EngineConfig(model=smol_model_dir, dtype="bfloat16", device="cpu", threads=2),
                                 smol_model_dir)
    assert with_two_threads.fast_decoder.kernels is None  # a one-core kernels: oneDNN spreads over the threads
    with_two_threads.close()
    torch.set_num_threads(threads)


def test_kernels_that_compute_wrong_numbers_are_not_used(monkeypatch, caplog, smol_model_dir):
    monkeypatch.setattr(native.Bf16Kernels, "computes_correctly", lambda self: False)
    with caplog.at_level(logging.WARNING, logger="engine.backends.native"):
        assert native.load_bf16_kernels(default_cache_dir()) is None
    assert "wrong numbers" in caplog.text
    backend = HFBackend(EngineConfig(model=smol_model_dir, dtype="bfloat16", device="cpu", threads=1),
                        smol_model_dir)
    assert backend.fast_decoder is not None and backend.fast_decoder.kernels is None
    backend.close()


def test_no_kernels_without_the_cpu_instructions_or_a_working_compiler(monkeypatch, caplog, tmp_path):
    with caplog.at_level(logging.INFO, logger="engine.backends.native"):
        monkeypatch.setattr(native, "_cpu_flags", lambda: {"avx2", "avx512f"})
        assert native.load_bf16_kernels(str(tmp_path)) is None
        assert "lacks avx512_bf16, avx512bw, avx512vl" in caplog.text
        monkeypatch.undo()
        monkeypatch.setenv("CC", "false")  # a compiler that fails
        assert native.load_bf16_kernels(str(tmp_path)) is None
        assert "could not build" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))  # nothing half-built left to load later


def test_processes_that_build_it_at_once_all_load_it(tmp_path):
    """gunicorn workers and test processes may start together on an empty cache folder."""
    script = ("import sys; from engine.backends import native; "
              "sys.exit(0 if native.load_bf16_kernels(sys.argv[1]) is not None else 1)")
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

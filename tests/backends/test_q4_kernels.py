"""The embedded model on its own 4-bit blocks (engine/backends/q4.py, q4_kernels.c): which path this host runs and
why; the blocks are the model's weights; the matmul within its error bound and every row the same alone as in any
batch, with or without the helper thread; a prompt chunked, whole or decoded token by token computes the same bits;
quality against the float32 dequantized GGUF; the portable C under the capability mask; bad inputs refused. Each on
8-bit activations (weights=q4, llama.cpp's arithmetic) and on float32 ones (weights=exact)."""
import os
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import hardware
from engine.backends.fast_forward import FastDecoder
from engine.backends.hf import HFBackend
from engine.backends.kv_cache import RowKVCache, SlotKVCache, use_slot_attention
from engine.backends.q4 import (BLOCK_BYTES, FORMAT_Q4_1, FORMAT_Q4_1_X8, FORMAT_Q8_0, FORMAT_Q8_0_X8, Q4Weights,
                               SlotTables, QuantizedWeight, KEY_BLOCK, error_bound, key_positions, load_q4_kernels)
from engine.config import EngineConfig, default_cache_dir

# A fixed English text (the model's own kind of answer) for the quality check.
TEXT = ("The ocean covers more than seventy percent of the surface of the Earth. It holds most of the planet's "
        "water and is home to a vast range of life, from tiny plankton to the blue whale, the largest animal that "
        "has ever lived. Ocean currents carry heat from the equator toward the poles and shape the weather on "
        "land. Scientists study the ocean with ships, buoys and satellites, and yet much of the deep sea remains "
        "unexplored. Protecting it from pollution and overfishing is one of the great tasks of this century.")


ACTIVATIONS = {"8-bit": False, "float32": True}


@pytest.fixture(scope="module", params=ACTIVATIONS)
def kernels(request):
    loaded = load_q4_kernels(default_cache_dir(), helpers=1, exact=ACTIVATIONS[request.param])
    assert loaded is not None, "a host with a C compiler runs the 4-bit kernels; see the log"
    return loaded


@pytest.fixture(scope="module")
def gguf_model(smol_model_dir):
    """The float32 model given the GGUF's weights dequantized (the reference), and its blocks."""
    model = AutoModelForCausalLM.from_pretrained(smol_model_dir, dtype=torch.float32).eval()
    assert use_slot_attention(model)
    weights = Q4Weights.of_embedded_model(model.config, EngineConfig().cache_dir)
    weights.give_model_the_same_weights(model)
    return model, weights


@torch.inference_mode()
def test_this_host_computes_on_what_it_has(smol_model_dir):
    """The defaults: the model's 4-bit blocks on every CPU (AVX512-BF16 too), the kernels this CPU runs. Torch
    threads as configured (3, a 4-core CPU's default), but one on an ARMv8.0 core, where torch's threaded float64
    BLAS (the kernels' probe) dies of SIGILL."""
    host = hardware.detect_host()
    try:
        defaults = HFBackend(EngineConfig(model=smol_model_dir, device="cpu", threads=3), smol_model_dir)
        armv8_0 = host.arch in ("aarch64", "arm64") and "asimd" in host.flags and "atomics" not in host.flags
        assert torch.get_num_threads() == (1 if armv8_0 else 3)
    finally:
        torch.set_num_threads(1)  # as conftest sets it for the tests
    assert (defaults.info.weights, defaults.info.dtype) == ("q4_1", "float32")
    assert defaults.fast_decoder.q4 is not None and not defaults.fast_decoder.q4.exact
    assert "the model ships 4-bit weights" in defaults.info.compute_reason and host.isa in defaults.info.compute_reason
    defaults.close()
    backend = HFBackend(EngineConfig(model=smol_model_dir, device="cpu", weights="q4"), smol_model_dir)
    info = backend.info
    assert (info.weights, info.dtype) == ("q4_1", "float32")
    has_avx2 = {"avx2", "fma", "f16c"} <= host.flags
    has_vnni, has_neon = has_vnni_kernels(host.flags), has_neon_kernels(host.flags)
    assert backend.fast_decoder.q4.uses_avx2 == has_avx2
    assert backend.fast_decoder.q4.uses_vnni == has_vnni
    assert backend.fast_decoder.q4.uses_avx512 == has_avx512_kernels(host.flags)
    assert backend.fast_decoder.q4.uses_neon == has_neon
    assert backend.fast_decoder.q4.uses_neon_dot == (has_neon and "asimddp" in host.flags)
    neon = "NEON+dotprod" if "asimddp" in host.flags else "NEON"
    assert ("AVX2+FMA+VNNI" if has_vnni else "AVX2+FMA" if has_avx2 else neon if has_neon
            else "portable C") in info.compute
    assert host.isa in info.compute_reason and "weights=q4" in info.compute_reason
    assert not backend.fast_decoder.q4.exact and "8-bit activations" in info.compute
    # AVX2 and ARM64's NEON read the blocks regrouped by 8 rows (vertical dot products); the portable C reads
    # them as they are
    interleaved = has_avx2 or has_neon
    stack = backend.fast_decoder.q4_stack
    assert (set(stack.layer_formats), stack.lm_head_format) == (({FORMAT_Q4_1_X8}, FORMAT_Q8_0_X8) if interleaved
                                                                else ({FORMAT_Q4_1}, FORMAT_Q8_0))
    assert ("interleaved by 8 rows" in info.compute) == interleaved
    backend.close()
    exact = HFBackend(EngineConfig(model=smol_model_dir, device="cpu", weights="exact"), smol_model_dir)
    assert (exact.info.weights, exact.info.dtype) == ("q4_1", "float32")
    assert exact.fast_decoder.q4.exact and "float32 activations" in exact.info.compute
    # float32 activations read the same regrouped blocks (a float GEMM's broadcast FMAs), plain ones elsewhere
    assert (set(exact.fast_decoder.q4_stack.layer_formats), exact.fast_decoder.q4_stack.lm_head_format) == (
        ({FORMAT_Q4_1_X8}, FORMAT_Q8_0_X8) if interleaved else ({FORMAT_Q4_1}, FORMAT_Q8_0))
    assert "weights=exact" in exact.info.compute_reason
    exact.close()
    configured = HFBackend(EngineConfig(model=smol_model_dir, device="cpu", weights="exact", dtype="bfloat16"),
                           smol_model_dir)
    assert (configured.info.weights, configured.info.dtype) == ("", "bfloat16")  # the model's own forward in it
    assert "configured bfloat16" in configured.info.compute_reason
    configured.close()


def test_a_model_without_4_bit_blocks_keeps_its_weights(tiny_model_dir):
    backend = HFBackend(EngineConfig(model=tiny_model_dir, device="cpu"), tiny_model_dir)
    assert backend.info.weights == "" and (backend.fast_decoder is None or backend.fast_decoder.q4 is None)
    backend.close()


def test_the_blocks_are_the_models_weights(smol_model_dir, gguf_model):
    """Rounded to bfloat16, the dequantized blocks are the prepared safetensors, parameter by parameter: the
    blocks were read in transformers' order (q/k rows un-permuted) and fused in the fast forward's order."""
    prepared = AutoModelForCausalLM.from_pretrained(smol_model_dir, dtype=torch.bfloat16)
    model, _ = gguf_model
    for (name, exact), (_, rounded) in zip(model.named_parameters(), prepared.named_parameters()):
        assert torch.equal(exact.to(torch.bfloat16), rounded), name


@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_the_matmul_on_the_models_blocks_within_its_bound_and_row_by_row(kernels, gguf_model, rows):
    _, weights = gguf_model
    layer = weights.layers[0]
    generator = torch.Generator().manual_seed(rows)
    alone = load_q4_kernels(default_cache_dir(), helpers=0, exact=kernels.exact)
    for plain in (layer.qkv, layer.out, layer.gate_up, layer.down, weights.lm_head):
        x = torch.randn(rows, plain.in_features, generator=generator) * 3
        reference, bound = error_bound(x, plain.dequantized(), kernels.exact)
        interleaved = kernels.interleaved(plain)
        for weight in [plain] + ([interleaved] if interleaved is not plain else []):  # as stored, as the forward reads
            together = kernels.linear(x, weight)
            assert bool(((together.double() - reference).abs() <= bound).all())
            for row in range(rows):  # each row alone, and on one thread, the same bits
                assert torch.equal(kernels.linear(x[row:row + 1], weight), together[row:row + 1])
            assert torch.equal(alone.linear(x, weight), together)


@torch.inference_mode()
@pytest.mark.parametrize("in_features", [32, 96, 160])
def test_the_matmul_of_a_short_or_uneven_k_within_its_bound_and_row_by_row(kernels, gguf_model, in_features):
    """A K shorter than a float32 panel's slice (4 blocks on AVX-512) or not a multiple of it: the panel still holds
    its slice, and the sums carried from slice to slice give each row's bits alone."""
    _, weights = gguf_model
    generator = torch.Generator().manual_seed(in_features)
    for whole in (weights.layers[0].gate_up, weights.lm_head):  # Q4_1 and Q8_0
        row_bytes = whole.blocks.shape[1] * in_features // whole.in_features
        plain = QuantizedWeight(whole.blocks[:72, :row_bytes].contiguous(), whole.format, 72, in_features)
        weight = kernels.interleaved(plain)
        for rows in (3, 9, 17):
            x = torch.randn(rows, in_features, generator=generator) * 3
            reference, bound = error_bound(x, plain.dequantized(), kernels.exact)
            together = kernels.linear(x, weight)
            assert bool(((together.double() - reference).abs() <= bound).all())
            for row in range(rows):
                assert torch.equal(kernels.linear(x[row:row + 1], weight), together[row:row + 1])


def test_interleaving_regroups_the_same_bytes_and_rows_read_back_from_either(kernels, gguf_model):
    _, weights = gguf_model
    for plain in (weights.layers[0].qkv, weights.lm_head):
        interleaved = kernels.interleaved(plain)
        if not kernels.interleaves:
            assert interleaved is plain
            continue
        assert interleaved.format != plain.format and interleaved.blocks.shape == plain.blocks.shape
        assert torch.equal(interleaved.blocks.flatten().sort().values, plain.blocks.flatten().sort().values)
        # read back from the interleaved copy (the cache's layout), every row is the plain blocks' row
        assert torch.equal(interleaved.dequantized(), plain.dequantized())
        ids = torch.tensor([plain.out_features - 1, 0, 9, 9, 13])
        assert torch.equal(interleaved.rows(ids), plain.dequantized()[ids])
        assert torch.equal(kernels.dequantize_rows(plain, ids), interleaved.rows(ids))


@torch.inference_mode()
def test_a_prompt_chunked_whole_or_decoded_computes_the_same_bits(kernels, gguf_model):
    model, weights = gguf_model
    decoder = FastDecoder(model, q4=(kernels, weights))
    ids = torch.tensor(model_tokens(TEXT))[:90]
    whole_cache = decoder.new_prompt_cache(len(ids))
    whole = decoder.prefill(ids, 0, whole_cache, all_positions=True)
    chunked_cache, parts = decoder.new_prompt_cache(len(ids)), []
    for start, end in ((0, 31), (31, 32), (32, 90)):
        parts.append(decoder.prefill(ids[start:end], start, chunked_cache, all_positions=True))
    assert torch.equal(torch.cat(parts), whole)
    assert all(torch.equal(a, b) for a, b in zip(cached(whole_cache, 90), cached(chunked_cache, 90)))
    # two rows decoding in slots: row 0 feeds token 60 after a 60-token prompt; row 1 the whole prompt's next
    config = model.config
    cache = SlotKVCache(config.num_hidden_layers, config.num_key_value_heads, decoder.head_dim, kernels.kv_dtype,
                        torch.device("cpu"))
    short = decoder.new_prompt_cache(60)
    decoder.prefill(ids[:60], 0, short)
    cache.add_row([(layer.keys, layer.values) for layer in short.layers], 60)
    cache.add_row([(layer.keys, layer.values) for layer in whole_cache.layers], 90)
    position_ids, mask = cache.prepare_decode()
    logits = decoder.decode(torch.tensor([[int(ids[60])], [7]]), position_ids, mask, cache)
    assert torch.equal(logits[0], whole[60])


@torch.inference_mode()
def test_rows_in_caches_of_their_own_decode_the_bits_of_one_padded_cache(kernels, gguf_model):
    """The backend's batch on this path (RowKVCache): each row decodes in its prompt's own cache, a fork in a copy,
    one row past what it reserved in a larger one. Step by step, rows joining and leaving, every row's logits are
    the bits of the padded cache (SlotKVCache), while it holds the sum of the rows' positions, not rows x the
    longest."""
    model, weights = gguf_model
    decoder = FastDecoder(model, q4=(kernels, weights))
    config, ids = model.config, torch.tensor(model_tokens(TEXT))
    padded = SlotKVCache(config.num_hidden_layers, config.num_key_value_heads, decoder.head_dim, kernels.kv_dtype,
                         torch.device("cpu"))
    own = RowKVCache()
    tokens = []
    for start, length, answer in ((0, 61, 30), (2, 93, 3), (40, 17, 30)):  # the second outgrows its 96 positions
        prompt = decoder.new_prompt_cache(length + answer)
        decoder.prefill(ids[start:start + length], 0, prompt)
        padded.add_row([(layer.keys, layer.values) for layer in prompt.layers], length)
        own.add_row(prompt, length)
        tokens.append(int(ids[start + length]))
    padded.add_row([(keys, values) for keys, values in zip(own.rows[2].keys, own.rows[2].values)], 17)
    own.add_row(own.rows[2].copy(17), 17)  # a fork: n > 1
    tokens.append(tokens[2])

    def step(tokens: list[int]) -> list[int]:
        input_ids = torch.tensor(tokens)[:, None]
        got = decoder.decode(input_ids, own.prepare_decode()[0], None, own)
        expected = decoder.decode(input_ids, *padded.prepare_decode(), padded)
        own.finish_decode(), padded.finish_decode()
        assert torch.equal(got, expected)
        return got.argmax(dim=-1).tolist()

    for _ in range(12):
        tokens = step(tokens)
    assert own.reallocations == 1 and own.rows[1].capacity == 128 and own.lengths == padded.lengths
    assert own.positions == sum(row.capacity for row in own.rows) < padded.positions
    moves = own.remove_rows({0, 2})
    assert moves == padded.remove_rows({0, 2}) == [(3, 0)]
    tokens = [tokens[3], tokens[1]]
    for _ in range(4):
        tokens = step(tokens)
    assert own.shrink() == 96 + 48  # the rows that left: 91 and 47 positions reserved, in whole key blocks
    assert own.positions == sum(row.capacity for row in own.rows) and own.num_rows == 2


def test_prompts_fed_together_compute_what_each_computes_alone(kernels, gguf_model):
    """Chunks of several prompts in one pass (a burst of new requests): of other lengths, caches and capacities,
    one a second chunk after cached positions, one a single token: each prompt's logits and keys and values are
    the bits its chunks give alone."""
    model, weights = gguf_model
    decoder = FastDecoder(model, q4=(kernels, weights))
    assert decoder.prefills_together
    ids = torch.tensor(model_tokens(TEXT))
    prompts = [(ids[:17], 0), (ids[5:80], 0), (ids[40:41], 0), (ids[:90][60:], 60), (ids[3:36], 0)]
    alone, together = [], []
    for chunk, start in prompts:
        capacity = start + len(chunk) + 7 * len(alone)  # capacities of their own
        caches = [decoder.new_prompt_cache(capacity) for _ in range(2)]
        if start:  # the cached part, fed before as one prompt's first chunk
            for cache in caches:
                decoder.prefill(ids[:start], 0, cache)
        alone.append((decoder.prefill(chunk, start, caches[0]), caches[0]))
        together.append((chunk, start, caches[1]))
    logits = decoder.prefill_many(together)
    assert logits.shape == (len(prompts), model.config.vocab_size)
    for (expected, cache), got, (chunk, start, fed) in zip(alone, logits, together):
        assert torch.equal(got, expected)
        end = start + len(chunk)  # past it the caches hold what their memory held
        assert all(torch.equal(a, b) for a, b in zip(cached(cache, end), cached(fed, end)))


def cached(cache, end: int) -> list[torch.Tensor]:
    """A prompt cache's keys and values of positions 0..end-1, per layer (keys read back from their blocks)."""
    return [key_positions(keys)[:, :, :end] for keys in cache.keys] + [values[:, :, :end] for values in cache.values]


@torch.inference_mode()
def test_quality_against_the_float32_dequantized_gguf(kernels, gguf_model):
    """The 8-bit rounding of activations (as llama.cpp's) costs little: the next-token argmax agrees with the
    float32 model on most positions of a fixed text, and the perplexity is within 2% of its; on float32
    activations only the order of sums differs from it: nearly every argmax, the perplexity within 0.1%."""
    model, weights = gguf_model
    decoder = FastDecoder(model, q4=(kernels, weights))
    ids = torch.tensor(model_tokens(TEXT))
    reference = model(input_ids=ids[None]).logits[0]
    got = decoder.prefill(ids, 0, decoder.new_prompt_cache(len(ids)), all_positions=True)
    agreement = float((reference.argmax(-1) == got.argmax(-1)).float().mean())

    def perplexity(logits):
        return float(torch.nn.functional.cross_entropy(logits[:-1], ids[1:]).exp())

    print(f"\nargmax agreement {agreement:.3f}, perplexity {perplexity(got):.3f} vs {perplexity(reference):.3f}")
    assert agreement >= (0.98 if kernels.exact else 0.88)  # 8-bit: 0.922 here (AVX2); other ISAs sum otherwise
    assert abs(perplexity(got) / perplexity(reference) - 1) < (0.001 if kernels.exact else 0.02)


PORTABLE_MASK = "avx2,fma,f16c,avx512f,asimd"  # what hosts that run the portable C lack, x86 and ARM64


def has_vnni_kernels(flags) -> bool:
    """Whether q4_kernels.c builds its VNNI dot products for a CPU with these flags (its LOCKSTEP_VNNI)."""
    return {"avx2", "fma", "f16c"} <= flags and ({"avx512_vnni", "avx512vl", "avx512f"} <= flags
                                                  or "avx_vnni" in flags)


def has_neon_kernels(flags) -> bool:
    """Whether q4_kernels.c builds its NEON tiles for a CPU with these flags (ARM64's asimd: its LOCKSTEP_NEON; with
    asimddp too their 8-bit dot products are sdot, LOCKSTEP_NEON_DOT)."""
    return platform.machine() in ("aarch64", "arm64") and "asimd" in flags


def has_avx512_kernels(flags) -> bool:
    """Whether q4_kernels.c builds its 16-column AVX-512 tiles for a CPU with these flags (its LOCKSTEP_AVX512)."""
    return {"avx2", "fma", "f16c", "avx512f", "avx512bw"} <= flags


def kernels_with_flags_hidden(monkeypatch, folder, hidden: str, exact: bool = False):
    """The kernels as a host without the `hidden` flags (comma-separated) builds them, and that host's flags."""
    monkeypatch.setenv(hardware.CAPABILITY_MASK_ENV, hidden)
    try:
        return load_q4_kernels(str(folder), helpers=1, exact=exact), hardware.detect_host().flags
    finally:
        monkeypatch.delenv(hardware.CAPABILITY_MASK_ENV)


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_the_portable_c_under_the_capability_mask(monkeypatch, tmp_path, gguf_model, activations):
    """What a host without AVX2 runs, built and checked here by hiding the instructions from the compiler."""
    portable, masked_flags = kernels_with_flags_hidden(monkeypatch, tmp_path, PORTABLE_MASK, ACTIVATIONS[activations])
    assert portable is not None and not portable.uses_avx2 and not portable.uses_neon
    assert "portable C" in portable.name and not portable.interleaves
    assert not {"avx2", "fma", "asimd"} & masked_flags
    _, weights = gguf_model
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(0))
    for weight in (weights.layers[0].qkv, weights.lm_head):
        reference, bound = error_bound(x, weight.dequantized(), portable.exact)
        assert bool(((portable.linear(x, weight).double() - reference).abs() <= bound).all())
    if portable.exact:  # the whole forward (its attention reads the key blocks): the float32 model's logits
        model, _ = gguf_model
        decoder, ids = FastDecoder(model, q4=(portable, weights)), torch.tensor(model_tokens(TEXT))[:90]
        cache = decoder.new_prompt_cache(len(ids))
        got = torch.cat([decoder.prefill(ids[:50], 0, cache, all_positions=True),
                         decoder.prefill(ids[50:], 50, cache, all_positions=True)])
        with torch.inference_mode():
            reference = model(input_ids=ids[None]).logits[0]
        assert torch.allclose(got, reference, atol=1e-3) and torch.equal(got.argmax(-1), reference.argmax(-1))


def fused_multiply_add(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """a * b + c rounded once to float32 (as an FMA instruction), for float32 arrays: the product is exact in
    float64, the sum's rounding error is recovered exactly (TwoSum), and it decides where the float64 sum lands on a
    float32 tie."""
    product, addend = a.astype(np.float64) * b.astype(np.float64), c.astype(np.float64)
    total = product + addend
    virtual = total - product
    error = (product - (total - virtual)) + (addend - virtual)
    rounded = total.astype(np.float32)
    toward = np.nextafter(rounded, np.where(total > rounded, np.float32(np.inf), np.float32(-np.inf)))
    tie = (total == (rounded.astype(np.float64) + toward.astype(np.float64)) / 2) & (error != 0)
    away = tie & ((error > 0) == (toward > rounded))  # the exact sum lies past the tie, on toward's side
    return np.where(away, toward, rounded)


def matmul_as_documented(x: torch.Tensor, weight: QuantizedWeight, fused: bool) -> torch.Tensor:
    """q4_kernels.c's 8-bit matmul, operation by operation in float32, from its comments: each block of 32 of a row
    of x to 8 bits (dx = amax / 127, q = x / dx to the nearest, ties to even; sx = dx * sum q), then per block the
    integer dot product whole, acc += dot * (dw * dx) and, for Q4_1, minimum += mw * sx, in block order; out =
    acc + minimum. `fused`: the tiles' FMAs (the interleaving builds: AVX2, AVX-512, ARM64's NEON); else each
    multiply and add rounded apart (the portable C)."""
    f32 = np.float32
    xs = x.numpy().astype(f32).reshape(x.shape[0], -1, 32)  # [M, blocks, 32]
    dx = np.abs(xs).max(-1) / f32(127)
    inverse = np.where(dx != 0, f32(1) / np.where(dx != 0, dx, f32(1)), f32(0)).astype(f32)
    q = np.rint(xs * inverse[..., None]).astype(np.int64)
    sx = (dx * q.sum(-1).astype(f32)).astype(f32)
    raw = weight.blocks.numpy().reshape(weight.out_features, -1, BLOCK_BYTES[weight.format])
    dw = raw[..., 0:2].copy().view(np.float16).astype(f32)[..., 0]  # [N, blocks]
    if weight.format == FORMAT_Q4_1:
        nibbles = raw[..., 4:].astype(np.int64)
        w = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1)
        mw = raw[..., 2:4].copy().view(np.float16).astype(f32)[..., 0]
    else:
        w, mw = raw[..., 2:].copy().view(np.int8).astype(np.int64), np.zeros_like(dw)
    acc = minimum = np.zeros((x.shape[0], weight.out_features), dtype=f32)
    for b in range(xs.shape[1]):
        dot = (q[:, b] @ w[:, b].T).astype(f32)  # [M, N], exact
        scale = (dw[None, :, b] * dx[:, b, None]).astype(f32)
        sums = np.broadcast_to(sx[:, b, None], acc.shape).astype(f32)
        mws = np.broadcast_to(mw[None, :, b], acc.shape).astype(f32)
        if fused:
            acc, minimum = fused_multiply_add(dot, scale, acc), fused_multiply_add(mws, sums, minimum)
        else:
            acc, minimum = (acc + dot * scale).astype(f32), (minimum + mws * sums).astype(f32)
    return torch.from_numpy(acc + minimum if weight.format == FORMAT_Q4_1 else acc)


def exact_matmul_as_documented(x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
    """The interleaving builds' matmul on float32 activations, from q4_kernels.c's comments: each weight
    dequantized as gguf-py does (d * q + m in one FMA, exact as its multiply, then add), then each output one chain
    of FMAs over K in order."""
    dense = weight.dequantized().numpy()  # [N, K], the same float32 numbers
    xs, acc = x.numpy(), np.zeros((x.shape[0], weight.out_features), dtype=np.float32)
    for position in range(weight.in_features):
        acc = fused_multiply_add(xs[:, position, None], dense[None, :, position], acc)
    return torch.from_numpy(acc)


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_every_build_computes_the_documented_arithmetic_bit_for_bit(monkeypatch, tmp_path, gguf_model,
                                                                     activations):
    """This host's matmul (AVX2, AVX-512, VNNI or ARM64's NEON tiles, which fuse each multiply-add) gives exactly
    the float32 operations its comments document, at each tile's row counts and both block formats: so every
    interleaving build gives the same bits as any other, x86's and ARM64's alike. So does, on an ARM64 core with
    sdot, the NEON build a core without it runs (its 16-bit multiply-adds), and on 8-bit activations the portable
    C (which rounds each multiply and add apart)."""
    exact = ACTIVATIONS[activations]
    native = load_q4_kernels(str(tmp_path / "native"), helpers=1, exact=exact)
    portable, _ = kernels_with_flags_hidden(monkeypatch, tmp_path / "portable", PORTABLE_MASK, exact)
    assert not portable.interleaves
    others = [portable]
    if native.uses_neon_dot:
        without_sdot, _ = kernels_with_flags_hidden(monkeypatch, tmp_path / "no-asimddp", "asimddp", exact)
        assert without_sdot.uses_neon and not without_sdot.uses_neon_dot and "(NEON," in without_sdot.name
        others.append(without_sdot)
    builds = [kernels for kernels in (native, *others) if kernels.interleaves or not exact]
    if not builds:  # the portable C's float32 sums are in lanes: checked against their bound elsewhere
        pytest.skip("this CPU has neither AVX2+FMA+F16C nor ARM64's NEON (asimd), so no build here computes the "
                    "float32 activations' one chain of FMAs")
    _, weights = gguf_model
    for rows in (1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)) * 3
        x[0, :32] = 0  # a block of zeros: dx = 0
        for whole in (weights.layers[0].gate_up, weights.lm_head):
            weight = QuantizedWeight(whole.blocks[:24].contiguous(), whole.format, 24, whole.in_features)
            for kernels in builds:
                expected = exact_matmul_as_documented(x, weight) if exact else \
                    matmul_as_documented(x, weight, fused=kernels.interleaves)
                assert torch.equal(kernels.linear(x, kernels.interleaved(weight)), expected), (kernels.name, rows)


@pytest.mark.skipif(not has_vnni_kernels(hardware.cpu_flags()),
                    reason="this CPU has no AVX512-VNNI or AVX-VNNI (vpdpbusd), so no VNNI dot products are built here")
def test_the_vnni_dot_products_give_the_avx2_bits(monkeypatch, tmp_path, gguf_model):
    """vpdpbusd sums the same integer products as AVX2's maddubs + madd: every output the same bits, at every
    row count of the tiles (1 to 9 rows), for both block formats."""
    vnni = load_q4_kernels(str(tmp_path / "vnni"), helpers=1)
    avx2, _ = kernels_with_flags_hidden(monkeypatch, tmp_path / "avx2", "avx512f,avx512_vnni,avx_vnni")
    assert vnni.uses_vnni and "VNNI" in vnni.name and avx2.uses_avx2 and not avx2.uses_vnni
    _, weights = gguf_model
    for rows in (1, 3, 8, 9):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        for weight in (weights.layers[0].gate_up, weights.lm_head):
            assert torch.equal(vnni.linear(x, vnni.interleaved(weight)), avx2.linear(x, avx2.interleaved(weight)))


@pytest.mark.skipif(not has_avx512_kernels(hardware.cpu_flags()),
                    reason="this CPU has no AVX-512 (avx512f, avx512bw), so no 16-column AVX-512 tiles are built here")
@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_the_avx512_kernels_give_the_avx2_bits(monkeypatch, tmp_path, gguf_model, activations):
    """Two groups' 16 columns in one vector, lane by lane the AVX2 tiles' operations: every output the same bits,
    at each tile's row counts (float32: 1 and 2 from the blocks, 3 and past from a panel, on AVX-512 32 columns
    and 4 blocks of K at a time in tiles of up to 8 rows; 8-bit: from 5 rows on, 8 rows a tile and the rest in one,
    with VNNI and without), both block formats, and a weight whose last 8 columns fall to the 8-column tile. The
    attention (two positions a vector for the scores, 16 dimensions for the sums) gives the same logits too, in
    prompt chunks and decode steps."""
    exact = ACTIVATIONS[activations]
    wide = load_q4_kernels(str(tmp_path / "avx512"), helpers=1, exact=exact)
    avx2, _ = kernels_with_flags_hidden(monkeypatch, tmp_path / "avx2", "avx512f,avx512_vnni,avx_vnni", exact)
    assert wide.uses_avx512 and "AVX-512" in wide.name and avx2.uses_avx2 and not avx2.uses_avx512
    without_bw, flags = kernels_with_flags_hidden(monkeypatch, tmp_path / "no-avx512bw", "avx512bw", exact)
    assert not has_avx512_kernels(flags) and not without_bw.uses_avx512  # the mask hides what the tiles need
    builds = [wide]
    if not exact:  # AVX-512 without VNNI (as Skylake-X): the 16-column dot products by maddubs + madd
        without_vnni, _ = kernels_with_flags_hidden(monkeypatch, tmp_path / "no-vnni", "avx512_vnni,avx_vnni")
        assert without_vnni.uses_avx512 and not without_vnni.uses_vnni
        builds.append(without_vnni)
    _, weights = gguf_model
    lm_head = weights.lm_head
    odd = QuantizedWeight(lm_head.blocks[:584].clone(), lm_head.format, 584, lm_head.in_features)  # 36 x 16 + 8
    for rows in (1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 19):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        for weight in (weights.layers[0].gate_up, weights.layers[0].qkv, lm_head, odd):
            expected = avx2.linear(x, avx2.interleaved(weight))
            for build in builds:
                assert torch.equal(build.linear(x, build.interleaved(weight)), expected)
    model, _ = gguf_model
    expected = attention_logits(avx2, model, weights)
    for build in builds:
        assert all(torch.equal(got, want) for got, want in zip(attention_logits(build, model, weights), expected))


def attention_logits(kernels, model, weights) -> list[torch.Tensor]:
    """Logits of a 203-token prompt in two chunks (the second attends over 150 cached positions, and the
    positions' counts leave tails of 1 to 3 past four and of 8 past 16), then of a decode step of two rows of
    other lengths."""
    decoder = FastDecoder(model, q4=(kernels, weights))
    ids = torch.randint(100, 20000, (203,), generator=torch.Generator().manual_seed(0))
    whole, short = decoder.new_prompt_cache(203), decoder.new_prompt_cache(61)
    chunks = [decoder.prefill(ids[start:end], start, whole, all_positions=True) for start, end in ((0, 150),
                                                                                                 (150, 203))]
    decoder.prefill(ids[:61], 0, short)
    config = model.config
    cache = SlotKVCache(config.num_hidden_layers, config.num_key_value_heads, decoder.head_dim, kernels.kv_dtype,
                        torch.device("cpu"))
    cache.add_row([(layer.keys, layer.values) for layer in short.layers], 61)
    cache.add_row([(layer.keys, layer.values) for layer in whole.layers], 203)
    position_ids, mask = cache.prepare_decode()
    return [*chunks, decoder.decode(torch.tensor([[7], [11]]), position_ids, mask, cache)]


def test_processes_that_build_it_at_once_all_load_it(tmp_path):
    script = ("import sys, torch; from engine import hardware; from engine.backends import q4; "
              "torch.set_num_threads(hardware.torch_threads(torch.get_num_threads(), hardware.detect_host())[0]); "
              "sys.exit(0 if q4.load_q4_kernels(sys.argv[1], 1) is not None else 1)")
    builders = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path)]) for _ in range(4)]
    assert [builder.wait(timeout=180) for builder in builders] == [0, 0, 0, 0]
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1


def test_a_compiler_that_fails_means_no_kernels(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", "false")
    assert load_q4_kernels(str(tmp_path), helpers=0) is None
    assert "could not build" in caplog.text
    assert not list((tmp_path / "kernels").glob("*.so"))


def test_it_refuses_inputs_it_cannot_read(kernels, gguf_model):
    model, weights = gguf_model
    weight = weights.layers[0].out
    with pytest.raises(ValueError):
        kernels.linear(torch.ones(2, 576, dtype=torch.bfloat16), weight)
    with pytest.raises(ValueError):
        kernels.linear(torch.ones(2, 100), weight)
    with pytest.raises(IndexError):
        kernels.dequantize_rows(weights.lm_head, torch.tensor([49152]))
    for bad in ([49152], [-1]):  # the embedding's lookup, of the blocks or their interleaved copy
        with pytest.raises(IndexError):
            weights.token_rows(torch.tensor(bad))
        with pytest.raises(IndexError):
            kernels.interleaved(weights.lm_head).rows(torch.tensor(bad))
    with pytest.raises(ValueError):
        QuantizedWeight.concat(weights.layers[0].out, weights.layers[0].down)
    decoder = FastDecoder(model, q4=(kernels, weights))
    cache = decoder.new_prompt_cache(4)  # room for a whole key block: 16 positions
    assert cache.keys[0].shape[2] == KEY_BLOCK
    with pytest.raises(ValueError):  # past the prompt cache's capacity
        decoder.prefill(torch.tensor([1, 2, 3]), KEY_BLOCK - 2, cache)
    with pytest.raises(ValueError):  # past the smaller of two prompts' caches, fed together
        decoder.prefill_many([(torch.tensor([1, 2]), 0, decoder.new_prompt_cache(20)),
                              (torch.tensor([1, 2, 3]), KEY_BLOCK - 2, cache)])
    ids, positions, tables = torch.tensor([1, 2]), torch.tensor([0, 1]), SlotTables([(cache.keys, cache.values)])
    hidden, (cos, sin) = decoder.token_rows(ids), decoder.rotary_table(positions)
    for slots, logit_rows in ((torch.tensor([0, 1]), torch.tensor([1])), (torch.tensor([0, 0]), torch.tensor([2])),
                              (torch.tensor([0, 0]), torch.tensor([0, 1, 1]))):  # no slot 1; no row 2; 3 of 2 rows
        with pytest.raises(ValueError):
            kernels.forward(decoder.q4_stack, hidden.clone(), slots, positions, cos, sin, tables, logit_rows)
    other_model = [torch.zeros(1, 2, 4, 64)] * model.config.num_hidden_layers  # 2 KV heads, not 3
    with pytest.raises(ValueError):
        kernels.forward(decoder.q4_stack, hidden.clone(), torch.tensor([0, 0]), positions, cos, sin,
                        SlotTables([(other_model, other_model)]), torch.tensor([1]))
    with pytest.raises(ValueError):  # keys and values of other shapes
        SlotTables([(cache.keys, other_model)])
    part_block = [torch.zeros(1, 3, KEY_BLOCK + 4, 64)] * model.config.num_hidden_layers
    with pytest.raises(ValueError):  # a capacity that ends inside a key block
        SlotTables([(part_block, part_block)])
    other_dtype = [torch.zeros(1, 3, KEY_BLOCK, 64, dtype=torch.float16 if kernels.exact else torch.float32)]
    with pytest.raises(ValueError):  # keys and values in the dtype the other activations keep them in
        kernels.forward(decoder.q4_stack, hidden.clone(), torch.tensor([0, 0]), positions, cos, sin,
                        SlotTables([(other_dtype * model.config.num_hidden_layers,) * 2]), torch.tensor([1]))
    with pytest.raises(ValueError):  # nor any other
        SlotTables([([torch.zeros(1, 3, KEY_BLOCK, 64, dtype=torch.float64)] * model.config.num_hidden_layers,) * 2])


def model_tokens(text: str) -> list[int]:
    from transformers import AutoTokenizer

    from engine.model_store import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir(default_cache_dir()))(text)["input_ids"]


def test_the_blocks_are_repacked_once_and_mapped_from_the_cache_after(kernels, gguf_model, tmp_path, monkeypatch):
    """The first start writes the blocks in the kernels' layout into the cache; later starts map them (no block is
    repacked: the repack raises here) and read the very bytes; a replaced file is repacked again and its earlier
    cache removed; a cache whose index was lost is rewritten, not read; a write that fails, or whose writer was
    killed, leaves no partial folder behind."""
    from engine.backends import block_repack, q4
    from engine.model_store import find_gguf

    model, reference = gguf_model
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(find_gguf().read_bytes())
    written = Q4Weights.from_gguf(str(gguf), model.config, kernels, str(tmp_path / "cache"))
    [folder] = (tmp_path / "cache" / "blocks").iterdir()
    assert (folder / "index.json").exists() and not list(folder.parent.glob("*.partial"))

    def no_repack(*args, **kwargs):
        raise AssertionError("a cached block was repacked")

    monkeypatch.setattr(q4, "kernel_blocks", no_repack)
    mapped = Q4Weights.from_gguf(str(gguf), model.config, kernels, str(tmp_path / "cache"))
    for first, again, plain in ((written.lm_head, mapped.lm_head, reference.lm_head),
                                (written.layers[3].gate_up, mapped.layers[3].gate_up, reference.layers[3].gate_up)):
        assert again.format == kernels.interleaved(plain).format
        assert torch.equal(again.blocks, first.blocks) and torch.equal(again.blocks, kernels.interleaved(plain).blocks)
    assert str(folder / "blocks.bin") in open("/proc/self/maps").read()  # mapped, not read into memory
    ids = torch.tensor([0, 1, 504, 49151])
    assert torch.equal(mapped.token_rows(ids), model.get_input_embeddings().weight[ids])  # tied: the lm_head's rows
    monkeypatch.setattr(q4, "kernel_blocks", block_repack.kernel_blocks)

    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file replaced
    Q4Weights.from_gguf(str(gguf), model.config, kernels, str(tmp_path / "cache"))
    [replaced] = (tmp_path / "cache" / "blocks").iterdir()
    assert replaced != folder
    (replaced / "index.json").write_text("{")
    abandoned = replaced.with_name(f"{replaced.name}.999999999.partial")  # its writer killed mid-write
    abandoned.mkdir()
    monkeypatch.setattr(q4, "kernel_blocks", no_repack)
    with pytest.raises(AssertionError, match="repacked"):  # rewritten, not read: and this write fails
        Q4Weights.from_gguf(str(gguf), model.config, kernels, str(tmp_path / "cache"))
    assert [path.name for path in (tmp_path / "cache" / "blocks").iterdir()] == [replaced.name]  # no partial left


@pytest.mark.parametrize("type_name, block_bytes", [("Q4_K", 144), ("Q6_K", 210)])
def test_the_c_repack_of_k_quants_writes_the_numpy_repacks_bytes(kernels, type_name, block_bytes):
    """block_repack.py's numpy is the reference (gguf-py's dequantization and Q8_0 rounding); the C that repacks a
    big file's Q4_K and Q6_K tensors (and Q4_1 as Q8_0) writes the same bytes: normal, tiny (float16 subnormal)
    and zero scales, and for Q4_K a scale past float16's range refused alike (the tensor then rounded to Q8_0)."""
    from engine.backends.block_repack import kernel_blocks, q8_0_of

    rng = np.random.default_rng(7)
    rows, columns = 64, 1024
    data = rng.integers(0, 256, (rows, columns // 256 * block_bytes), dtype=np.uint8)
    blocks = data.reshape(rows, -1, block_bytes)
    scales = (rng.standard_normal(blocks.shape[:2]) * 1e-2).astype(np.float16)
    scales[:4] = np.float16(1e-7)  # subnormal
    scales[4:6] = 0
    offset = 0 if type_name == "Q4_K" else 208
    blocks[..., offset:offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    if type_name == "Q4_K":
        blocks[..., 2:4] = np.abs(scales).view(np.uint8).reshape(*blocks.shape[:2], 2)
    expected, written = kernel_blocks(type_name, data, rows), kernel_blocks(type_name, data, rows, kernels)
    assert expected[0] == written[0] and np.array_equal(expected[1], written[1])
    if type_name == "Q4_K":  # and its Q4_1 blocks as Q8_0 (q/k/v fused where v came as Q6_K)
        assert np.array_equal(kernels.q4_1_as_q8_0(written[1]), q8_0_of(FORMAT_Q4_1, written[1]))
        assert kernels.q4_k_as_q4_1(data) is not None
        blocks[7, 0, 0:2] = np.frombuffer(np.float16(60000).tobytes(), np.uint8)  # d sc past float16
        assert kernels.q4_k_as_q4_1(data) is None
        with np.errstate(over="ignore"):
            expected, written = kernel_blocks(type_name, data, rows), kernel_blocks(type_name, data, rows, kernels)
        assert expected[0] == written[0] and np.array_equal(expected[1], written[1])

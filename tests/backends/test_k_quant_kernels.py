"""A file's Q4_0, Q4_K and Q6_K blocks read as they are (q4_kernels.c's Q4_0_X8, Q4_K_X8 and Q6_K_X8, where the
kernels interleave):
the repack writes the documented layout (a numpy reference, byte for byte); rows read back as gguf-py dequantizes
them; the matmul within its bound, every row the same bits alone as in any batch; the very bits of Q4_1_X8 where the
numbers are the same (a Q4_0 tensor either way, a Q4_K one whose scales fit float16); AVX-512's tiles the AVX2 tiles'
bits; fused weights of mixed types as before; and small GGUF files of Q4_K, of Q4_0 and of Q6_K served with the
float32 model's greedy tokens on gguf-py's weights. Each on 8-bit activations and on float32 ones (exact)."""
import numpy as np
import pytest
import torch

from engine import SamplingParams, hardware
from engine.backends import block_repack
from engine.backends.block_repack import fused_parts, kernel_blocks
from engine.backends.q4 import (FORMAT_Q4_0, FORMAT_Q4_0_X8, FORMAT_Q4_1, FORMAT_Q4_1_X8, FORMAT_Q4_K, FORMAT_Q4_K_X8,
                               FORMAT_Q6_K, FORMAT_Q6_K_X8, FORMAT_Q8_0, QuantizedWeight, error_bound, load_q4_kernels)
from engine.config import default_cache_dir

from ..torch_jobs import run_job

ACTIVATIONS = {"8-bit": False, "float32": True}
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 16, 19)  # each tile's row counts: 8-column, 16-column from 5, panels from 3
AVX2_MASK = "avx512f,avx512_vnni,avx_vnni"  # what an AVX2-only host lacks (the Makefile's test-avx2-path)


@pytest.fixture(scope="module", params=ACTIVATIONS)
def kernels(request):
    loaded = load_q4_kernels(default_cache_dir(), helpers=1, exact=ACTIVATIONS[request.param])
    assert loaded is not None, "a host with a C compiler runs the 4-bit kernels; see the log"
    if not loaded.interleaves:
        pytest.skip("these kernels interleave nothing (the portable C): a file's Q4_0 and Q4_K are read as Q4_1")
    return loaded


def q4_k_blocks(rng: np.random.Generator, rows: int, columns: int, exact_in_float16: bool = False) -> np.ndarray:
    """Random Q4_K blocks [rows, columns / 256 * 144] (every 6-bit scale and minimum pattern), weights of about 0.1;
    `exact_in_float16`: d and dmin powers of two, so every d sc and dmin m is a float16 (the Q4_1 repack is exact)."""
    blocks = rng.integers(0, 256, (rows, columns // 256, 144), dtype=np.uint8)
    if exact_in_float16:
        scales = np.float16(2.0) ** -rng.integers(10, 14, (rows, columns // 256, 2)).astype(np.float16)
    else:
        scales = (rng.uniform(0.5, 1.0, (rows, columns // 256, 2)) * 1e-4).astype(np.float16)
    blocks[..., 0:4] = scales.view(np.uint8).reshape(rows, columns // 256, 4)
    return blocks.reshape(rows, -1)


def q4_0_blocks(rng: np.random.Generator, rows: int, columns: int) -> np.ndarray:
    blocks = rng.integers(0, 256, (rows, columns // 32, 18), dtype=np.uint8)
    scales = (rng.standard_normal((rows, columns // 32)) * 0.01).astype(np.float16)
    blocks[..., 0:2] = scales.view(np.uint8).reshape(rows, columns // 32, 2)
    return blocks.reshape(rows, -1)


def q6_k_blocks(rng: np.random.Generator, rows: int, columns: int) -> np.ndarray:
    """Random Q6_K blocks [rows, columns / 256 * 210] (every 6-bit q and int8 scale), weights of about 0.05."""
    blocks = rng.integers(0, 256, (rows, columns // 256, 210), dtype=np.uint8)
    d = (rng.uniform(0.5, 1.0, (rows, columns // 256)) * 5e-5).astype(np.float16)
    blocks[..., 208:210] = d.view(np.uint8).reshape(rows, columns // 256, 2)
    return blocks.reshape(rows, -1)


def gguf_dequantized(data: np.ndarray, type_name: str) -> torch.Tensor:
    from gguf import GGMLQuantizationType, quants

    return torch.from_numpy(np.asarray(quants.dequantize(data, GGMLQuantizationType[type_name]), dtype=np.float32))


def q4_k_x8_reference(data: np.ndarray) -> np.ndarray:
    """Q4_K_X8 as q4_kernels.c documents it, per group of 8 rows and super-block: the 8 fp16 d, the 8 fp16 dmin,
    sub-block j's 8 scales, then its 8 minimums (gguf-py's unpacking), then per sub-block Q4_1_X8's nibbles: 4
    vectors of 32 bytes, vector v holding bytes 4v..4v+3 of each row's 16 (value i low, value i + 16 high)."""
    from gguf.quants import Q4_K

    rows = data.shape[0]
    blocks = data.reshape(rows // 8, 8, -1, 144).transpose(0, 2, 1, 3)  # [groups, supers, 8 rows, 144]
    shape = blocks.shape[:3]
    scales, minimums = (part.reshape(*shape, 8) for part in Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12)))
    chunks = blocks[..., 16:].reshape(*shape, 4, 1, 32)
    values = ((chunks >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F).reshape(*shape, 8, 32)
    nibbles = values[..., :16] | (values[..., 16:] << 4)  # [groups, supers, rows, sub-blocks, 16]
    vectors = nibbles.reshape(*shape, 8, 4, 4).transpose(0, 1, 3, 4, 2, 5)  # [groups, supers, sub, vector, row, 4]
    out = np.concatenate([blocks[..., 0:2].reshape(*shape[:2], 16), blocks[..., 2:4].reshape(*shape[:2], 16),
                          scales.transpose(0, 1, 3, 2).reshape(*shape[:2], 64).astype(np.uint8),
                          minimums.transpose(0, 1, 3, 2).reshape(*shape[:2], 64).astype(np.uint8),
                          vectors.reshape(*shape[:2], 1024)], axis=-1)
    return out.reshape(rows, -1)


def q4_0_x8_reference(data: np.ndarray) -> np.ndarray:
    """Q4_0_X8: per group of 8 rows and block, the 8 fp16 d, then Q4_1_X8's 4 vectors of nibbles."""
    rows = data.shape[0]
    blocks = data.reshape(rows // 8, 8, -1, 18).transpose(0, 2, 1, 3)  # [groups, blocks, 8 rows, 18]
    vectors = blocks[..., 2:].reshape(*blocks.shape[:3], 4, 4).transpose(0, 1, 3, 2, 4)
    out = np.concatenate([blocks[..., 0:2].reshape(*blocks.shape[:2], 16),
                          vectors.reshape(*blocks.shape[:2], 128)], axis=-1)
    return out.reshape(rows, -1)


def q6_k_x8_reference(data: np.ndarray) -> np.ndarray:
    """Q6_K_X8: per group of 8 rows and super-block, the 8 fp16 d, sub-block s's 8 int8 scales (s = 0..15), then
    per block of 32 values Q4_1_X8's 4 vectors of their low 4 bits (value i low, i + 16 high), then two planes of
    32 bytes of their high 2 bits, byte 4j + t holding in bits 2v, 2v + 1 those of row j's value 4v + t (first
    plane) or 16 + 4v + t (second)."""
    rows = data.shape[0]
    blocks = data.reshape(rows // 8, 8, -1, 210).transpose(0, 2, 1, 3)  # [groups, supers, 8 rows, 210]
    shape = blocks.shape[:3]
    d = blocks[..., 208:210].reshape(*shape[:2], 16)
    scales = blocks[..., 192:208].transpose(0, 1, 3, 2).reshape(*shape[:2], 128)
    # gguf-py's unpacking (Q6_K.dequantize_blocks): each 128 values' low 4 bits in 64 bytes, their high 2 in 32
    ql = (blocks[..., :128].reshape(*shape, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & 0x0F
    qh = (blocks[..., 128:192].reshape(*shape, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3
    q = ql.reshape(*shape, 2, 4, 32) | (qh.reshape(*shape, 2, 4, 32) << 4)  # [.., 128-value half, 32-value part, 32]
    q = q.reshape(*shape, 8, 2, 16)  # [groups, supers, rows, block, half, 16]
    nibbles = ((q[..., 0, :] & 0x0F) | ((q[..., 1, :] & 0x0F) << 4)).reshape(*shape, 8, 4, 4)
    nibbles = nibbles.transpose(0, 1, 3, 4, 2, 5).reshape(*shape[:2], 8, 128)  # [.., block, vector, row, 4]
    high = (q >> 4).reshape(*shape, 8, 2, 4, 4) << (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    planes = np.bitwise_or.reduce(high, axis=-2).transpose(0, 1, 3, 4, 2, 5).reshape(*shape[:2], 8, 64)
    per_block = np.concatenate([nibbles, planes], axis=-1).reshape(*shape[:2], 8 * 192)
    return np.concatenate([d, scales, per_block], axis=-1).reshape(rows, -1)


def random_weights(seed: int, rows: int = 40, columns: int = 512) -> dict[int, QuantizedWeight]:
    """A Q4_0, a Q4_K and a Q6_K weight of random blocks, as the file holds them (plain)."""
    rng = np.random.default_rng(seed)
    makers = {FORMAT_Q4_0: q4_0_blocks, FORMAT_Q4_K: q4_k_blocks, FORMAT_Q6_K: q6_k_blocks}
    return {format_: QuantizedWeight(torch.from_numpy(make(rng, rows, columns)), format_, rows, columns)
            for format_, make in makers.items()}


def test_the_c_repack_writes_the_documented_layout(kernels):
    rng = np.random.default_rng(1)
    for type_name, make, reference, format_ in (("Q6_K", q6_k_blocks, q6_k_x8_reference, FORMAT_Q6_K_X8),
                                                ("Q4_K", q4_k_blocks, q4_k_x8_reference, FORMAT_Q4_K_X8),
                                                ("Q4_0", q4_0_blocks, q4_0_x8_reference, FORMAT_Q4_0_X8)):
        data = make(rng, 24, 768)
        plain = QuantizedWeight(torch.from_numpy(data), block_repack.NATIVE[type_name], 24, 768)
        interleaved = kernels.interleaved(plain)
        assert interleaved.format == format_
        assert np.array_equal(interleaved.blocks.numpy(), reference(data))
    # Q4_K_X8: 1184 bytes per 8 rows x 256 weights (4.625 bits a weight), Q4_0_X8 the file's 18 per 32
    assert interleaved.blocks.shape == (24, 768 // 32 * 18)
    assert kernels.interleaved(QuantizedWeight(torch.from_numpy(q4_k_blocks(rng, 8, 256)), FORMAT_Q4_K, 8, 256)) \
        .blocks.numel() == 1184
    # Q6_K_X8: the file's 210 bytes per row and 256 weights (6.5625 bits a weight; Q8_0: 8.5)
    assert kernels.interleaved(QuantizedWeight(torch.from_numpy(q6_k_blocks(rng, 8, 256)), FORMAT_Q6_K, 8, 256)) \
        .blocks.numel() == 1680


def test_rows_read_back_as_gguf_py_dequantizes_them(kernels):
    """gguf-py's own numbers ((d sc) q - dmin m for Q4_K, d (q - 8) for Q4_0, (d sc) (q - 32) for Q6_K), bit for bit: from the file's blocks,
    from their interleaved copy (numpy, the tied embedding's lookup) and from the C (lockstep_q4_dequantize_rows)."""
    ids = torch.tensor([39, 0, 7, 8, 8, 21])
    names = {FORMAT_Q4_0: "Q4_0", FORMAT_Q4_K: "Q4_K", FORMAT_Q6_K: "Q6_K"}
    for format_, plain in random_weights(2).items():
        expected = gguf_dequantized(plain.blocks.numpy(), names[format_])
        interleaved = kernels.interleaved(plain)
        assert torch.equal(plain.dequantized(), expected)
        assert torch.equal(interleaved.dequantized(), expected)
        assert torch.equal(interleaved.rows(ids), expected[ids])
        assert torch.equal(kernels.dequantize_rows(interleaved, ids), expected[ids])
        assert torch.equal(kernels.dequantize_rows(plain, ids), expected[ids])
        with pytest.raises(ValueError, match="format these kernels do not read"):  # only the interleaved copy
            kernels.linear(torch.zeros(1, plain.in_features), plain)


@torch.inference_mode()
def test_the_matmul_within_its_bound_and_each_row_alone_the_same(kernels):
    """Against float64 on gguf-py's dequantized weights, within error_bound; each row alone, on one thread or two,
    and among any other rows, the same bits (batch invariance), at each tile's row count."""
    alone = load_q4_kernels(default_cache_dir(), helpers=0, exact=kernels.exact)
    for format_, plain in random_weights(3, rows=72).items():
        weight = kernels.interleaved(plain)
        for rows in ROWS:
            x = torch.randn(rows, plain.in_features, generator=torch.Generator().manual_seed(rows)) * 3
            reference, bound = error_bound(x, plain.dequantized(), kernels.exact)
            together = kernels.linear(x, weight)
            assert bool(((together.double() - reference).abs() <= bound).all()), (format_, rows)
            for row in range(rows):
                assert torch.equal(kernels.linear(x[row:row + 1], weight), together[row:row + 1]), (format_, rows)
            assert torch.equal(alone.linear(x, weight), together)
            assert torch.equal(kernels.linear(x[:1].expand(rows, -1), weight)[-1], together[0])


def odd_shapes(weight: QuantizedWeight) -> list[QuantizedWeight]:
    """The weight, and its first 24 rows (16-column tiles, then the last 8 columns alone)."""
    head = weight.blocks[:24].contiguous()
    return [weight, QuantizedWeight(head, weight.format, 24, weight.in_features)]


@torch.inference_mode()
def test_the_new_formats_give_the_q4_1_x8_bits_where_the_numbers_are_the_same(kernels):
    """A Q4_0 tensor as Q4_0_X8 (m = -8 d) or as Q4_1_X8 (m = -8 d in float16), and a Q4_K tensor whose d sc and
    dmin m are float16 numbers as Q4_K_X8 or as Q4_1_X8: the same weights, so the same operations give the same bits,
    at every tile's row count."""
    rng = np.random.default_rng(4)
    q4_0, q4_k = q4_0_blocks(rng, 40, 512), q4_k_blocks(rng, 40, 512, exact_in_float16=True)
    for type_name, data in (("Q4_0", q4_0), ("Q4_K", q4_k)):
        native_format, native = kernel_blocks(type_name, data, 40, kernels, interleaved=True)
        q4_1_format, q4_1 = kernel_blocks(type_name, data, 40, kernels)
        assert (native_format, q4_1_format) == (block_repack.NATIVE[type_name], FORMAT_Q4_1)
        as_native = kernels.interleaved(QuantizedWeight(torch.from_numpy(native), native_format, 40, 512))
        as_q4_1 = kernels.interleaved(QuantizedWeight(torch.from_numpy(q4_1), FORMAT_Q4_1, 40, 512))
        assert as_q4_1.format == FORMAT_Q4_1_X8 and torch.equal(as_native.dequantized(), as_q4_1.dequantized())
        assert as_native.blocks.numel() < as_q4_1.blocks.numel()
        for rows in ROWS:
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
            x[0, :32] = 0  # a block of zeros: its 8-bit scale is 0
            for native_weight, q4_1_weight in zip(odd_shapes(as_native), odd_shapes(as_q4_1)):
                assert torch.equal(kernels.linear(x, native_weight), kernels.linear(x, q4_1_weight)), (type_name, rows)


@pytest.fixture(scope="module")
def avx2_build(tmp_path_factory):
    """The kernels as an AVX2-only host builds them (the capability mask), where this host has AVX-512."""
    if not {"avx512f", "avx512bw"} <= hardware.cpu_flags():
        pytest.skip("this CPU has no AVX-512 (avx512f, avx512bw): no 16-column tiles to compare with the 8-column ones")
    folder = tmp_path_factory.mktemp("avx2")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(hardware.CAPABILITY_MASK_ENV, AVX2_MASK)
        builds = {exact: load_q4_kernels(str(folder), helpers=1, exact=exact) for exact in (False, True)}
    assert all(build.uses_avx2 and not build.uses_avx512 and not build.uses_vnni for build in builds.values())
    return builds


@torch.inference_mode()
def test_the_avx512_tiles_give_the_avx2_bits(kernels, avx2_build):
    """16 columns a vector (8-bit: from 5 rows; float32: panels of 32 columns from 3 rows, 16-column row tiles
    below) lane by lane the 8-column tiles' operations, VNNI's dot products maddubs's sums."""
    assert kernels.uses_avx512
    avx2 = avx2_build[kernels.exact]
    for plain in random_weights(5).values():
        for rows in ROWS:
            x = torch.randn(rows, plain.in_features, generator=torch.Generator().manual_seed(rows))
            for wide, narrow in zip(odd_shapes(kernels.interleaved(plain)), odd_shapes(avx2.interleaved(plain))):
                assert torch.equal(kernels.linear(x, wide), avx2.linear(x, narrow)), (plain.format, rows)


def test_fused_parts_of_mixed_types_are_fused_as_before(kernels):
    """q/k/v or gate/up whose types differ: a file's Q4_0 and Q4_K blocks become Q4_1 as where the kernels keep no
    native format, then Q4_1 where all are, else Q8_0: the bytes of before. One type: its own format."""
    rng = np.random.default_rng(6)
    q4_0, q4_k, q6_k = q4_0_blocks(rng, 16, 256), q4_k_blocks(rng, 16, 256), q6_k_blocks(rng, 16, 256)
    q4_1, q8_0 = (rng.integers(0, 127, (16, 8 * size)).astype(np.uint8) for size in (20, 34))  # scales < 2^-5

    def fused(*parts: tuple[str, np.ndarray], interleaved: bool) -> tuple[int, np.ndarray]:
        chosen, data = fused_parts([kernel_blocks(name, data, 16, kernels, interleaved) for name, data in parts],
                                   kernels)
        return chosen, np.concatenate(data)

    for parts in ((("Q4_0", q4_0), ("Q4_K", q4_k)), (("Q4_K", q4_k), ("Q8_0", q8_0)), (("Q4_0", q4_0), ("Q4_1", q4_1)),
                  (("Q4_K", q4_k), ("Q4_K", q4_k), ("Q6_K", q6_k)), (("Q6_K", q6_k), ("Q8_0", q8_0))):
        before, now = fused(*parts, interleaved=False), fused(*parts, interleaved=True)
        assert now[0] == before[0] and np.array_equal(now[1], before[1]), [name for name, _ in parts]
    assert fused(("Q4_K", q4_k), ("Q4_K", q4_k), interleaved=True)[0] == FORMAT_Q4_K
    assert fused(("Q4_0", q4_0), ("Q4_0", q4_0), interleaved=True)[0] == FORMAT_Q4_0
    assert fused(("Q4_K", q4_k), ("Q8_0", q8_0), interleaved=True)[0] == FORMAT_Q8_0
    assert kernel_blocks("Q4_K", q4_k[:12], 12, kernels, interleaved=True)[0] == FORMAT_Q4_1  # rows not in 8s
    # Q6_K: the file's blocks where the kernels read Q6_K_X8 and the rows come in 8s, else Q8_0 as before
    assert fused(("Q6_K", q6_k), ("Q6_K", q6_k), interleaved=True)[0] == FORMAT_Q6_K
    assert kernel_blocks("Q6_K", q6_k[:12], 12, kernels, interleaved=True)[0] == FORMAT_Q8_0
    assert kernel_blocks("Q6_K", q6_k, 16, kernels)[0] == FORMAT_Q8_0


# -- files of Q4_K and of Q4_0 blocks, served -----------------------------------------------------------------------

PROMPTS = ([1, 504, 3575, 282, 4649, 314], [1, 19556, 665], [28, 216, 29, 216, 30])
# (projections, token embedding and lm_head): a tied family all Q4_K (quantized from normal values: random Q4_K
# blocks lean one way, and such a model answers one token to everything), an untied one all Q4_0, a tied one all Q6_K
FILES = {"qwen3": ("Q4_K", "Q4_K"), "llama": ("Q4_0", "Q4_0"), "qwen2": ("Q6_K", "Q6_K")}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def k_quant_files(tmp_path_factory, smol_model_dir) -> dict[str, dict]:
    files = {}
    for family, (type_name, embedding_type) in FILES.items():
        target = tmp_path_factory.mktemp(family)
        files.update(run_job("build_gguf_models", target=str(target), families=[family],
                             tokenizer_dir=smol_model_dir, types=[type_name], embedding_type=embedding_type,
                             prompts=PROMPTS, quantize_q4_k=True))
    return files


@pytest.mark.parametrize("family", FILES)
def test_a_file_of_k_quant_or_q4_0_blocks_is_served_as_gguf_py_dequantizes_it(k_quant_files, family, make_engine,
                                                                              cache_dir):
    """With float32 activations the kernels' greedy tokens are transformers' float32 model's on gguf-py's
    dequantized weights (the reference folder), its projections (q/k/v and gate/up fused) and lm_head read as
    Q4_K_X8, Q4_0_X8 or Q6_K_X8 where the kernels read them (the token embedding looked up in them, tied or
    untied)."""
    files = k_quant_files[family]
    engine = make_engine(files["gguf"], cache_dir=cache_dir, dtype="auto", weights="exact")
    assert "4-bit kernels" in engine.info.compute
    interleaves = "interleaved by 8 rows" in engine.info.compute
    type_name = FILES[family][0]
    assert engine.info.weights == (type_name.lower() if interleaves else "q8_0" if type_name == "Q6_K" else "q4_1")
    if not interleaves and type_name == "Q6_K":
        pytest.skip("kernels that interleave nothing read Q6_K rounded to Q8_0")
    if not interleaves and type_name == "Q4_K":
        pytest.skip("kernels that interleave nothing read Q4_K as Q4_1, its scales rounded to float16")
    served = [engine.submit(prompt_token_ids=list(prompt), sampling=SamplingParams(max_tokens=8, temperature=0,
                                                                                   ignore_eos=True)).result(120)
              .output_token_ids for prompt in PROMPTS]
    assert served == [tuple(tokens) for tokens in files["greedy"]] and len(set(served)) == len(PROMPTS)


def test_a_q6_k_file_on_8_bit_activations_gives_each_prompt_its_tokens_alone_or_among_others(k_quant_files,
                                                                                              make_engine, cache_dir):
    """The whole decode step with Q6_K_X8's 8-bit tiles (projections, lm_head, the tied embedding's lookup): each
    prompt's greedy tokens the same decoded alone as among the others (batch invariance)."""
    engine = make_engine(k_quant_files["qwen2"]["gguf"], cache_dir=cache_dir, dtype="auto", weights="q4")
    if "interleaved by 8 rows" not in engine.info.compute:
        pytest.skip("kernels that interleave nothing read Q6_K rounded to Q8_0")
    assert engine.info.weights == "q6_k"
    sampling = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone = [engine.submit(prompt_token_ids=list(prompt), sampling=sampling).result(120).output_token_ids
             for prompt in PROMPTS]
    futures = [engine.submit(prompt_token_ids=list(prompt), sampling=sampling) for prompt in PROMPTS]
    assert [future.result(120).output_token_ids for future in futures] == alone and len(set(alone)) == len(PROMPTS)

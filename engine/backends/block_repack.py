"""A GGUF tensor's blocks as lockstep's 4-bit kernels read them: Q4_1 or Q8_0 blocks of 32 values, or, for kernels
that read their blocks interleaved by 8 rows (AVX2, ARM64's NEON), a file's Q4_0, Q4_K and Q6_K blocks as they are
(the kernels' Q4_0_X8, Q4_K_X8 and Q6_K_X8 read them: the file's bytes a weight and gguf-py's numbers).

Where a type's values fit one of those formats, the repack keeps them: Q4_1 and Q8_0 as they are; Q4_0 (d (q - 8))
as Q4_1 with m = -8 d; Q5_0 (d (q - 16), q < 32) as Q8_0 with the same d; Q4_K, whose every 32 values are
d sc q - dmin m with q < 16, as Q4_1 with d sc and -dmin m rounded to float16 (at most 2^-11 of a scale, far
below the 4-bit steps). Every other type (Q5_1, Q5_K, Q6_K, F16, BF16, F32) is rounded to Q8_0, 8 bits per 32
values as llama.cpp rounds activations: within half a step of 1/127 of each block's largest value. The bytes a step
reads stay close to the file's: a Q4_K weight becomes 0.625 bytes per value instead of 0.5625 (as Q4_K_X8,
0.578), a Q6_K one 1.0625 instead of 0.8203 (as Q6_K_X8, 0.8203).
"""
import numpy as np

FORMAT_Q4_1, FORMAT_Q8_0, FORMAT_Q4_0, FORMAT_Q4_K, FORMAT_Q6_K = 0, 1, 6, 7, 9  # q4.py's (q4_kernels.c's enum)
BLOCK = 32
KEPT = ("Q4_1", "Q8_0", "Q4_0", "Q5_0", "Q4_K")  # types repacked without rounding their values (Q4_K: scales)
ROUNDED = ("Q5_1", "Q5_K", "Q6_K", "F16", "BF16", "F32")
REPACKED = KEPT + ROUNDED
NATIVE = {"Q4_0": FORMAT_Q4_0, "Q4_K": FORMAT_Q4_K, "Q6_K": FORMAT_Q6_K}  # the file's own blocks, for kernels that
# interleave
NATIVE_TYPES = {format_: type_name for type_name, format_ in NATIVE.items()}


def kernel_blocks(type_name: str, data: np.ndarray, out_features: int, native=None,
                  interleaved: bool = False) -> tuple[int, np.ndarray]:
    """(format, blocks [out_features, row bytes]) of a tensor stored as `type_name`, whose bytes `data` holds row
    by row. `native`: the loaded kernels, whose C repacks Q4_K and Q6_K (the types of a Q4_K_M file's big tensors)
    to the same bytes as this module's numpy, 50-100x as fast. `interleaved`: for kernels that read Q4_0_X8 and
    Q4_K_X8 and Q6_K_X8 (their interleaved copy is made later, as for Q4_1), Q4_0, Q4_K and Q6_K stay the file's
    blocks where the rows come in groups of 8; elsewhere they become Q4_1 (Q6_K: Q8_0)."""
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(out_features, -1)
    if interleaved and out_features % 8 == 0 and type_name in NATIVE:
        return NATIVE[type_name], data
    if native is not None and type_name == "Q6_K":
        return FORMAT_Q8_0, native.q6_k_as_q8_0(data)
    if type_name == "Q4_1":
        return FORMAT_Q4_1, data
    if type_name == "Q8_0":
        return FORMAT_Q8_0, data
    if type_name == "Q4_0":
        return FORMAT_Q4_1, _q4_0_as_q4_1(data)
    if type_name == "Q4_K":
        blocks = _q4_k_as_q4_1(data) if native is None else native.q4_k_as_q4_1(data)
        if blocks is not None:
            return FORMAT_Q4_1, blocks
    if type_name == "Q5_0":
        return FORMAT_Q8_0, _q5_0_as_q8_0(data)
    if type_name not in REPACKED:
        raise ValueError(f"no repack of {type_name} blocks for the 4-bit kernels")
    return FORMAT_Q8_0, as_q8_0(dequantized(data, type_name))


def as_q8_0(values: np.ndarray) -> np.ndarray:
    """float32 [rows, columns] rounded to Q8_0 blocks (gguf-py's quantization: d = max |x| / 127)."""
    from gguf import GGMLQuantizationType, quants

    return np.asarray(quants.quantize(np.ascontiguousarray(values, dtype=np.float32), GGMLQuantizationType.Q8_0))


def q8_0_of(format_: int, blocks: np.ndarray, native=None) -> np.ndarray:
    """Blocks of either format as Q8_0 (a fused weight whose parts came in both: one format for all); `native`: the
    loaded kernels, whose C writes the same bytes."""
    if format_ == FORMAT_Q8_0:
        return blocks
    return as_q8_0(dequantized(blocks, "Q4_1")) if native is None else native.q4_1_as_q8_0(blocks)


def fused_parts(parts: list[tuple[int, np.ndarray]], native=None) -> tuple[int, list[np.ndarray]]:
    """One format for the parts of a fused weight (q/k/v, gate/up), whose rows are then concatenated: theirs where
    they share one; else, as where no format is kept native, a file's Q4_0 and Q4_K as Q4_1 (Q6_K as Q8_0), then
    Q4_1 where all are, else Q8_0."""
    formats = {format_ for format_, _ in parts}
    if len(formats) == 1:
        return formats.pop(), [data for _, data in parts]
    parts = [kernel_blocks(NATIVE_TYPES[format_], data, data.shape[0], native) if format_ in NATIVE_TYPES
             else (format_, data) for format_, data in parts]
    if {format_ for format_, _ in parts} == {FORMAT_Q4_1}:
        return FORMAT_Q4_1, [data for _, data in parts]
    return FORMAT_Q8_0, [q8_0_of(format_, data, native) for format_, data in parts]


def dequantized(data: np.ndarray, type_name: str) -> np.ndarray:
    """A type's blocks as float32 values, as gguf-py dequantizes them."""
    from gguf import GGMLQuantizationType, quants

    return np.asarray(quants.dequantize(data, GGMLQuantizationType[type_name]), dtype=np.float32)


def _q4_0_as_q4_1(data: np.ndarray) -> np.ndarray:
    blocks = data.reshape(data.shape[0], -1, 18)
    d = blocks[..., 0:2].copy().view(np.float16)
    minimum = (d.astype(np.float32) * -8).astype(np.float16)  # a power of two: exact unless it overflows
    out = np.empty(blocks.shape[:2] + (20,), dtype=np.uint8)
    out[..., 0:2] = blocks[..., 0:2]
    out[..., 2:4] = minimum.view(np.uint8).reshape(*blocks.shape[:2], 2)
    out[..., 4:] = blocks[..., 2:]
    return out.reshape(data.shape[0], -1)


def _q5_0_as_q8_0(data: np.ndarray) -> np.ndarray:
    blocks = data.reshape(data.shape[0], -1, 22)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    values = dequantized(data, "Q5_0").reshape(blocks.shape[0], blocks.shape[1], BLOCK)
    with np.errstate(divide="ignore", invalid="ignore"):
        steps = np.where(d == 0, 0, np.rint(values / d))  # d (q - 16) / d: the integer exactly
    out = np.empty(blocks.shape[:2] + (34,), dtype=np.uint8)
    out[..., 0:2] = blocks[..., 0:2]
    out[..., 2:] = steps.astype(np.int8).view(np.uint8)
    return out.reshape(data.shape[0], -1)


def _q4_k_as_q4_1(data: np.ndarray) -> np.ndarray | None:
    """Each 256-value Q4_K block as 8 Q4_1 blocks, or None where a scale does not fit float16."""
    from gguf.quants import Q4_K

    rows = data.shape[0]
    blocks = data.reshape(-1, 144)
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])
    scales = (d * sc.astype(np.float32)).astype(np.float16)  # [blocks, 8 sub-blocks]
    minimums = (-(dmin * m.astype(np.float32))).astype(np.float16)
    if not (np.isfinite(scales).all() and np.isfinite(minimums).all()):
        return None
    # qs: 4 chunks of 32 bytes; a chunk's low nibbles are sub-block 2j's 32 values, its high ones sub-block 2j+1's.
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    values = (qs & 0x0F).reshape(-1, 8, BLOCK)
    out = np.empty((blocks.shape[0], 8, 20), dtype=np.uint8)
    out[..., 0:2] = scales.view(np.uint8).reshape(-1, 8, 2)
    out[..., 2:4] = minimums.view(np.uint8).reshape(-1, 8, 2)
    out[..., 4:] = values[..., :16] | (values[..., 16:] << 4)  # Q4_1: value i low nibble, value i + 16 high
    return out.reshape(rows, -1)

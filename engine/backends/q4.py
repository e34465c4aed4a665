"""A GGUF file's model (llama, qwen2, qwen3, gemma3; the embedded model's among them) computed on its own blocks
with lockstep's 4-bit kernels (q4_kernels.c): the blocks repacked once as Q4_1 or Q8_0, or kept as the file's Q4_0
and Q4_K where the kernels interleave (block_repack.py), read by lockstep's matmul, and a decode step or a prompt
chunk in one C call, built on first use with the system's C compiler (for this CPU: -march=native) into the cache
folder and loaded with ctypes.

`load_q4_kernels` returns None (and says why in the log) where they cannot run: no compiler, or a probe against
float64 that fails. `Q4Weights.from_gguf` reads the blocks, in transformers' row order, and hands the model the same
weights dequantized to float32 (what gguf-py computes), so the model's own forward and the kernels compute with
the same weights (the kernels round activations to 8 bits per 32, as llama.cpp). Nothing here runs at import time.
"""
import ctypes
import logging
import platform
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..gguf_file import GGUFFile, read_gguf
from ..hardware import cpu_flags
from ..memory import release_freed_memory
from .block_cache import BlockCache
from .block_repack import REPACKED, dequantized, fused_parts, kernel_blocks
from .c_build import built_library, find_compiler

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("q4_kernels.c")
# Instruction sets the capability mask (hardware.CAPABILITY_MASK_ENV) can take away from -march/-mcpu=native, so a
# host with them builds and tests the code a lesser host runs (x86 without AVX2: the portable C; on ARM64 the
# macros q4_kernels.c chooses its tiles by: without asimddp its NEON tiles multiply-add in 16 bits, without asimd
# the portable C runs).
MASKABLE_X86 = {"avx2": "-mno-avx2", "fma": "-mno-fma", "f16c": "-mno-f16c", "avx512f": "-mno-avx512f",
                "avx512bw": "-mno-avx512bw", "avx512_vnni": "-mno-avx512vnni", "avx_vnni": "-mno-avxvnni"}
MASKABLE_ARM64 = {"asimddp": "-U__ARM_FEATURE_DOTPROD", "asimd": "-U__ARM_NEON"}
LINK_FLAGS = ("-lm", "-pthread")
BLOCK = 32
# q4_kernels.c's formats. _X8: regrouped by 8 rows, which the AVX2 and NEON kernels read; plain Q4_0 and Q4_K are a
# file's own blocks, which those kernels read as their Q4_0_X8 and Q4_K_X8 copies (elsewhere block_repack.py makes
# them Q4_1).
FORMAT_Q4_1, FORMAT_Q8_0, FORMAT_Q4_1_X8, FORMAT_Q8_0_X8 = 0, 1, 2, 3
FORMAT_Q4_0_X8, FORMAT_Q4_K_X8, FORMAT_Q4_0, FORMAT_Q4_K = 4, 5, 6, 7
FORMAT_Q6_K_X8, FORMAT_Q6_K = 8, 9  # a file's Q6_K, read as Q6_K_X8 where the kernels interleave (elsewhere Q8_0)
BLOCK_BYTES = {FORMAT_Q4_1: 20, FORMAT_Q8_0: 34, FORMAT_Q4_1_X8: 20, FORMAT_Q8_0_X8: 34, FORMAT_Q4_0: 18,
               FORMAT_Q4_0_X8: 18}  # a row's bytes per block of 32 values
SUPER_BLOCK = 256
SUPER_BLOCK_BYTES = {FORMAT_Q4_K: 144, FORMAT_Q4_K_X8: 148,  # a row's bytes per 256 values (Q4_K_X8: 1184 / 8)
                     FORMAT_Q6_K: 210, FORMAT_Q6_K_X8: 210}
INTERLEAVED = {FORMAT_Q4_1: FORMAT_Q4_1_X8, FORMAT_Q8_0: FORMAT_Q8_0_X8, FORMAT_Q4_0: FORMAT_Q4_0_X8,
               FORMAT_Q4_K: FORMAT_Q4_K_X8, FORMAT_Q6_K: FORMAT_Q6_K_X8}
PLAIN = {interleaved: plain for plain, interleaved in INTERLEAVED.items()}
FORMAT_NAMES = {FORMAT_Q4_1: "q4_1", FORMAT_Q8_0: "q8_0", FORMAT_Q4_0: "q4_0", FORMAT_Q4_K: "q4_k",
                FORMAT_Q6_K: "q6_k"}


def block_shape(format_: int) -> tuple[int, int]:
    """(values, bytes) of a row's block in this format."""
    if format_ in SUPER_BLOCK_BYTES:
        return SUPER_BLOCK, SUPER_BLOCK_BYTES[format_]
    return BLOCK, BLOCK_BYTES[format_]


def format_name(format_: int) -> str:
    """"q4_1", "q8_0", "q4_0", "q4_k" or "q6_k", interleaved or not."""
    return FORMAT_NAMES[PLAIN.get(format_, format_)]


PROBE_ROWS = 19
# what lockstep_q4_forward computes (norms, biases: Q4Layer; Gemma 3's GeGLU, windows and local rotary: Q4Stack)
KERNEL_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # q4_kernels.c's ACTIVATION_*


def activation_of(config) -> str | None:
    """The MLP's activation, under either of transformers' names for it (Gemma's `hidden_activation`)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
# Keys are kept in blocks of this many positions, positions in lanes (q4_kernels.c's KEY_BLOCK): a cache's capacity
# is a multiple of it, and a copy of a cache's first positions copies whole blocks (key_positions reads them back).
KEY_BLOCK = 16


class Q4Kernels:
    """`linear(x, weight)` computes x @ W.T from a `QuantizedWeight`; `forward` runs every layer at once. With
    `exact`, activations stay float32 (the weights' own numbers: only the order of sums differs from the float32
    dequantized model); without, they are rounded to 8 bits per 32, as llama.cpp computes Q4_1."""

    def __init__(self, library: ctypes.CDLL, helpers: int, exact: bool = False):
        pointer, size, integer = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._linear = library.lockstep_q4_linear
        self._linear.argtypes = [pointer, pointer, integer, pointer, size, size, size, integer, integer]
        self._linear.restype = ctypes.c_int
        self._rows = library.lockstep_q4_dequantize_rows
        self._rows.argtypes = [pointer, integer, pointer, size, size, pointer]
        self._rows.restype = None
        self._forward = library.lockstep_q4_forward
        self._forward.argtypes = [pointer, size, pointer, pointer, pointer, pointer, pointer, pointer, pointer,
                                  pointer, pointer, pointer, size, pointer, pointer, pointer, pointer,
                                  ctypes.c_float, pointer, pointer, size, integer, integer]
        self._forward.restype = ctypes.c_int
        self._q4_k_as_q4_1 = library.lockstep_q4_k_as_q4_1
        self._q4_k_as_q4_1.argtypes = [pointer, size, pointer]
        self._q4_k_as_q4_1.restype = ctypes.c_int
        self._q6_k_as_q8_0 = library.lockstep_q6_k_as_q8_0
        self._q6_k_as_q8_0.argtypes = [pointer, size, pointer]
        self._q6_k_as_q8_0.restype = None
        self._q4_1_as_q8_0 = library.lockstep_q4_1_as_q8_0
        self._q4_1_as_q8_0.argtypes = [pointer, size, pointer]
        self._q4_1_as_q8_0.restype = None
        self._interleave = library.lockstep_q4_interleave
        self._interleave.argtypes = [pointer, integer, size, size, pointer]
        self._interleave.restype = None
        library.lockstep_q4_key_block.restype = ctypes.c_int64
        if library.lockstep_q4_key_block() != KEY_BLOCK:
            raise RuntimeError("q4_kernels.c keeps keys in blocks of another size than KEY_BLOCK")
        self.uses_avx2 = bool(library.lockstep_q4_uses_avx2())
        self.uses_vnni = bool(library.lockstep_q4_uses_vnni())  # the 8-bit dot products in one instruction
        self.uses_avx512 = bool(library.lockstep_q4_uses_avx512())  # 16 columns a vector, the AVX2 tiles' bits
        self.uses_neon = bool(library.lockstep_q4_uses_neon())  # ARM64's NEON tiles, the AVX2 tiles' bits
        self.uses_neon_dot = bool(library.lockstep_q4_uses_neon_dot())  # their 8-bit dot products by sdot
        self.helpers = helpers  # threads beside the caller that share a call's work
        self.exact = exact
        # the weights read regrouped by 8 rows (Q4_1_X8, Q8_0_X8), as the AVX2 kernels and ARM64's NEON tiles read
        # them (on AVX2 a one-row step 1.5x as fast); the portable C reads the plain blocks
        self.interleaves = bool(library.lockstep_q4_interleaves())
        # keys and values: float32 beside float32 activations, else float16 (half the bytes a step reads per
        # position; its 11 bits are more than the 8 the activations keep)
        self.kv_dtype = torch.float32 if exact else torch.float16

    @property
    def name(self) -> str:
        isa = "portable C"
        if self.uses_avx2:
            isa = "AVX2+FMA" + ("+VNNI" if self.uses_vnni and not self.exact else "") + \
                ("+AVX-512" if self.uses_avx512 else "")
        elif self.uses_neon:
            isa = "NEON+dotprod" if self.uses_neon_dot else "NEON"
        return f"lockstep's 4-bit kernels ({isa}, " \
               f"{'float32' if self.exact else '8-bit'} activations, {self.helpers + 1} threads" \
               f"{', blocks interleaved by 8 rows' if self.interleaves else ''})"

    def interleaved(self, weight: "QuantizedWeight") -> "QuantizedWeight":
        """A weight regrouped as the interleaved kernel reads it (the same bytes in another order), or the weight
        itself where these kernels read no interleaved copy."""
        if not self.interleaves or weight.format not in INTERLEAVED or weight.out_features % 8:
            return weight
        format_ = INTERLEAVED[weight.format]
        values, size = block_shape(format_)
        out = torch.empty((weight.out_features, weight.in_features // values * size), dtype=torch.uint8)
        self._interleave(weight.blocks.contiguous().data_ptr(), weight.format, weight.out_features,
                         weight.in_features, out.data_ptr())
        return QuantizedWeight(out, format_, weight.out_features, weight.in_features)

    def q4_k_as_q4_1(self, data: np.ndarray) -> np.ndarray | None:
        """block_repack's Q4_K repack, in C (the same bytes): None where a scale does not fit float16."""
        failed, out = _repacked(self._q4_k_as_q4_1, data, 144, 8 * 20)
        return None if failed else out

    def q6_k_as_q8_0(self, data: np.ndarray) -> np.ndarray:
        """block_repack's Q6_K repack (dequantized, rounded to Q8_0), in C (the same bytes)."""
        return _repacked(self._q6_k_as_q8_0, data, 210, 8 * 34)[1]

    def q4_1_as_q8_0(self, data: np.ndarray) -> np.ndarray:
        """block_repack.q8_0_of's Q4_1 blocks as Q8_0, in C (the same bytes)."""
        return _repacked(self._q4_1_as_q8_0, data, 20, 34)[1]

    def linear(self, x: torch.Tensor, weight: "QuantizedWeight") -> torch.Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != weight.in_features:
            raise ValueError(f"this matmul takes float32 CPU inputs of {weight.in_features} features, not "
                             f"{tuple(x.shape)} {x.dtype} on {x.device}")
        rows = x.reshape(-1, weight.in_features).contiguous()
        out = torch.empty((rows.shape[0], weight.out_features), dtype=torch.float32)
        failed = self._linear(rows.data_ptr(), weight.blocks.data_ptr(), weight.format, out.data_ptr(), rows.shape[0],
                              weight.out_features, weight.in_features, self.helpers, self.exact)
        if failed == -2:
            raise ValueError("linear: a format these kernels do not read (an interleaved one where they read none, "
                             "or rows % 8; a file's Q4_0, Q4_K or Q6_K not interleaved)")
        if failed:
            raise MemoryError("linear: no memory for its scratch buffer")
        return out.view(*x.shape[:-1], weight.out_features)

    def dequantize_rows(self, weight: "QuantizedWeight", ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight in float32 (the embedding lookup)."""
        ids = ids.to(torch.int64).contiguous()
        if ids.numel() and not bool(((ids >= 0) & (ids < weight.out_features)).all()):
            raise IndexError("token id outside the vocabulary")
        out = torch.empty((ids.numel(), weight.in_features), dtype=torch.float32)
        self._rows(weight.blocks.data_ptr(), weight.format, ids.data_ptr(), ids.numel(), weight.in_features,
                   out.data_ptr())
        return out.view(*ids.shape, weight.in_features)

    def forward(self, stack: "Q4Stack", hidden: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                cos: torch.Tensor, sin: torch.Tensor, caches: "SlotTables", logit_rows: torch.Tensor,
                local_rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Rows through every layer, then the logits [len(logit_rows), vocabulary] of the rows logit_rows lists.
        hidden [rows, hidden] (float32, the embedded tokens; overwritten): row r is the token at position
        positions[r] of slot slots[r] of `caches` (it writes its key and value there and attends to positions
        0..positions[r]), rotated by cos and sin [rows, head_dim] (by `local_rotary`'s in sliding-window layers,
        where given). A decode step: slot r for row r; a prompt chunk: one slot, consecutive positions; chunks of
        several prompts: a slot each."""
        rows = hidden.shape[0]
        cos_local, sin_local = local_rotary if local_rotary is not None else (cos, sin)
        if not (_is_f32_cpu(hidden, cos, sin, cos_local, sin_local) and hidden.shape == (rows, stack.hidden)
                and cos.shape == sin.shape == cos_local.shape == sin_local.shape == (rows, stack.head_dim)):
            raise ValueError("forward: hidden states or rotary tables of the wrong shape or kind")
        if caches.num_layers != stack.num_layers or (caches.num_kv_heads, caches.head_dim) != (stack.num_kv_heads,
                                                                                               stack.head_dim):
            raise ValueError("forward: slot caches that do not fit the model")
        if caches.dtype != self.kv_dtype:
            raise ValueError(f"forward: these kernels keep keys and values in {self.kv_dtype}, not {caches.dtype}")
        if slots.dtype != torch.int64 or positions.dtype != torch.int64 or slots.shape != (rows,) \
                or positions.shape != (rows,) \
                or (rows and not bool(((slots >= 0) & (slots < caches.num_slots)).all())):
            raise ValueError("forward: a slot outside the slot cache")
        if rows and not bool(((positions >= 0) & (positions < caches.capacities[slots.clamp(0, caches.num_slots - 1)]))
                             .all()):
            raise ValueError("forward: a position outside the slot cache")
        if logit_rows.dtype != torch.int64 or logit_rows.dim() != 1 or len(logit_rows) > rows \
                or (len(logit_rows) and not bool(((logit_rows >= 0) & (logit_rows < rows)).all())):
            raise ValueError("forward: logit rows outside the rows")
        dims = (ctypes.c_int64 * 9)(stack.hidden, stack.num_heads, stack.num_kv_heads, stack.head_dim,
                                    stack.intermediate, caches.num_slots, stack.vocabulary, stack.lm_head_format,
                                    stack.activation)
        slots, positions, logit_rows = slots.contiguous(), positions.contiguous(), logit_rows.contiguous()
        logits = torch.empty((len(logit_rows), stack.vocabulary), dtype=torch.float32)
        failed = rows and self._forward(dims, stack.num_layers, stack.pointers, stack.formats, stack.eps,
                                        stack.windows, cos_local.data_ptr(), sin_local.data_ptr(),
                                        caches.keys.data_ptr(),
                                        caches.values.data_ptr(), caches.capacities.data_ptr(), hidden.data_ptr(),
                                        rows, slots.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                                        stack.scaling, logits.data_ptr(), logit_rows.data_ptr(), len(logit_rows),
                                        self.helpers, self.exact)
        if failed == -2:
            raise ValueError("forward: interleaved weights for kernels that do not read them")
        if failed:
            raise MemoryError("forward: no memory for the step's scratch buffers")
        return logits

    def computes_correctly(self) -> bool:
        """A probe on random blocks of both formats: within `error_bound` of the float64 product of the
        dequantized weights, and each row the same alone as among others (what batch invariance rests on)."""
        generator = np.random.default_rng(0)
        for fmt in (FORMAT_Q4_1, FORMAT_Q8_0):
            weight = QuantizedWeight(_random_blocks(generator, fmt, 37, 96), fmt, 37, 96)
            x = torch.from_numpy(generator.standard_normal((PROBE_ROWS, 96), dtype=np.float32))
            if not self._matmul_holds(weight, weight, x):
                return False
            rows = torch.tensor([3, 0, 36])
            if not torch.equal(self.dequantize_rows(weight, rows), weight.dequantized()[rows]):
                return False
        return not self.interleaves or self._interleaved_computes_correctly(generator)

    def _interleaved_computes_correctly(self, generator: np.random.Generator) -> bool:
        for fmt in INTERLEAVED:
            depth = 256 if fmt in SUPER_BLOCK_BYTES else 96
            weight = QuantizedWeight(_random_blocks(generator, fmt, 40, depth), fmt, 40, depth)
            x = torch.from_numpy(generator.standard_normal((PROBE_ROWS, depth), dtype=np.float32))
            interleaved, rows = self.interleaved(weight), torch.tensor([9, 0, 39])
            if not self._matmul_holds(interleaved, weight, x) or \
                    not torch.equal(self.dequantize_rows(interleaved, rows), weight.dequantized()[rows]):
                return False
        return True

    def _matmul_holds(self, read: "QuantizedWeight", plain: "QuantizedWeight", x: torch.Tensor) -> bool:
        """x @ W.T from `read` (the plain blocks or their interleaved copy) within `error_bound` of the float64
        product of `plain` dequantized, and each row the same alone as among the others."""
        together = self.linear(x, read)
        reference, bound = error_bound(x, plain.dequantized(), self.exact)
        return bool(((together.double() - reference).abs() <= bound).all()) and all(
            torch.equal(self.linear(x[row:row + 1], read), together[row:row + 1]) for row in range(x.shape[0]))


def error_bound(x: torch.Tensor, dense: torch.Tensor, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 product x @ dense.T, and how far the kernels may be from it: float32 sums, and without `exact`
    each block of 32 of a row of x rounded to 8 bits (at most half a step, amax / 254, per value)."""
    x, dense = x.double(), dense.double()
    float_sums = (x.abs() @ dense.abs().T) * 2 ** -18 + 1e-30
    if exact:
        return x @ dense.T, float_sums
    steps = x.view(x.shape[0], -1, BLOCK).abs().amax(-1) / 254  # [M, blocks]
    block_norms = dense.abs().view(dense.shape[0], -1, BLOCK).sum(-1)  # [N, blocks]
    return x @ dense.T, steps @ block_norms.T * (1 + 2 ** -10) + float_sums


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [out_features, in_features] as GGUF blocks: `blocks` is uint8 [out_features, row bytes] (block_shape:
    in_features / values a block, times its bytes)."""
    blocks: torch.Tensor
    format: int
    out_features: int
    in_features: int

    def dequantized(self) -> torch.Tensor:
        """float32, as gguf-py dequantizes (d * q, then + m; Q4_K: (d sc) q - dmin m)."""
        return self.rows(torch.arange(self.out_features))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` in float32 (the tied embedding's lookup), from the plain blocks or their interleaved copy."""
        ids = ids.to(torch.int64).reshape(-1).numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.out_features):
            raise IndexError("token id outside the vocabulary")
        raw = self.blocks.numpy()
        if self.format in (FORMAT_Q4_0, FORMAT_Q4_K, FORMAT_Q6_K):  # a file's own blocks: gguf-py's numbers
            return torch.from_numpy(dequantized(raw[ids], format_name(self.format).upper())
                                    .reshape(len(ids), self.in_features))
        values, size = block_shape(self.format)
        if self.format in PLAIN:  # each group of 8 rows holds block b of its rows together: gather row j's bytes
            groups = raw.reshape(self.out_features // 8, self.in_features // values, 8 * size)[ids // 8]
            positions = _interleaved_positions(self.format)[ids % 8]  # [rows, size]
            raw = np.take_along_axis(groups, positions[:, None, :], axis=2)
        else:
            raw = raw[ids].reshape(len(ids), -1, size)
        return torch.from_numpy(_dequantized_blocks(raw, PLAIN.get(self.format, self.format))
                                .reshape(len(ids), self.in_features))

    @staticmethod
    def concat(*weights: "QuantizedWeight") -> "QuantizedWeight":
        first = weights[0]
        if any(w.format != first.format or w.in_features != first.in_features for w in weights):
            raise ValueError("only weights of one format and width concatenate")
        return QuantizedWeight(torch.cat([w.blocks for w in weights]).contiguous(), first.format,
                               sum(w.out_features for w in weights), first.in_features)


@dataclass(frozen=True)
class PromptLayer:
    keys: torch.Tensor  # [1, kv_heads, capacity, head_dim], in blocks of KEY_BLOCK positions (key_positions)
    values: torch.Tensor


def key_positions(keys: torch.Tensor) -> torch.Tensor:
    """Keys [..., capacity, head_dim] as the forward keeps them (blocks of KEY_BLOCK positions, positions in lanes)
    read back position by position."""
    *outer, capacity, head_dim = keys.shape
    blocks = keys.reshape(*outer, capacity // KEY_BLOCK, head_dim, KEY_BLOCK)
    return blocks.transpose(-1, -2).reshape(*outer, capacity, head_dim)


class SlotTables:
    """Where `Q4Kernels.forward` finds each slot's keys and values: per layer and slot the address of that slot's
    [kv_heads, capacity, head_dim] block (float32 or float16, one dtype for all), and each slot's capacity. Slots
    are those of a batch's slot cache
    (one tensor per layer, [slots, kv_heads, capacity, head_dim]) or prompt caches, one slot each."""

    def __init__(self, caches: list[tuple[list[torch.Tensor], list[torch.Tensor]]]):
        first = caches[0][0][0]
        self.num_layers, (_, self.num_kv_heads, _, self.head_dim) = len(caches[0][0]), first.shape
        self.dtype = first.dtype
        for keys, values in caches:
            shapes = {tensor.shape for tensor in (*keys, *values)}
            if len(keys) != self.num_layers or len(values) != self.num_layers or len(shapes) != 1 \
                    or self.dtype not in (torch.float32, torch.float16) \
                    or not _is_cpu_contiguous(self.dtype, *keys, *values):
                raise ValueError("forward: one contiguous float32 or float16 slot cache per layer")
            if next(iter(shapes))[1::2] != (self.num_kv_heads, self.head_dim):
                raise ValueError("forward: slot caches that do not fit the model")
            if keys[0].shape[2] % KEY_BLOCK:
                raise ValueError(f"forward: a slot cache's capacity must be a multiple of {KEY_BLOCK} positions")
        # [layers, slots] addresses: slot s of a cache at its tensor's address + s blocks
        self.keys, self.values = (torch.cat([_slot_addresses(cache[part]) for cache in caches], dim=1).contiguous()
                                  for part in (0, 1))
        self.capacities = torch.cat([torch.full((cache[0][0].shape[0],), cache[0][0].shape[2], dtype=torch.int64)
                                     for cache in caches])
        self.num_slots = len(self.capacities)  # addresses only: valid while the caller holds the tensors


def _slot_addresses(tensors: list[torch.Tensor]) -> torch.Tensor:
    num_slots, block = tensors[0].shape[0], tensors[0][0].numel() * tensors[0].element_size()
    bases = torch.tensor([tensor.data_ptr() for tensor in tensors], dtype=torch.int64)
    return bases[:, None] + torch.arange(num_slots, dtype=torch.int64) * block


class PromptCache:
    """One prompt's keys and values while it is fed in chunks, as the slot cache lays out one slot (so a chunk is
    computed as decode steps are); `layers` as a DynamicCache's, which the backend copies into the batch."""

    def __init__(self, num_layers: int, num_kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype):
        shape = (num_layers, num_kv_heads, max(1, -(-capacity // KEY_BLOCK)) * KEY_BLOCK, head_dim)
        # every layer in one tensor: a prefix-cache hit restores one copy a block
        self.all_keys, self.all_values = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        self.layers = [PromptLayer(keys[None], values[None]) for keys, values in zip(self.all_keys, self.all_values)]

    @property
    def keys(self) -> list[torch.Tensor]:
        return [layer.keys for layer in self.layers]

    @property
    def values(self) -> list[torch.Tensor]:
        return [layer.values for layer in self.layers]

    @property
    def capacity(self) -> int:
        return self.all_keys.shape[2]

    def copy(self, length: int, capacity: int | None = None) -> "PromptCache":
        """A cache of `capacity` positions (default: this one's) holding this one's first `length` (whole blocks of
        keys: the kernels zero a block when they start it, so what follows in the last one is never read)."""
        num_layers, num_kv_heads, _, head_dim = self.all_keys.shape
        copied = PromptCache(num_layers, num_kv_heads, capacity or self.capacity, head_dim, self.all_keys.dtype)
        kept = min(self.capacity, copied.capacity, -(-length // KEY_BLOCK) * KEY_BLOCK)
        copied.all_keys[:, :, :kept] = self.all_keys[:, :, :kept]
        copied.all_values[:, :, :kept] = self.all_values[:, :, :kept]
        return copied


@dataclass(frozen=True)
class Q4Layer:
    qkv: QuantizedWeight
    out: QuantizedWeight
    gate_up: QuantizedWeight
    down: QuantizedWeight
    qkv_bias: torch.Tensor | None = None  # Qwen2: float32 [q + k + v widths]
    q_norm: torch.Tensor | None = None  # Qwen3, Gemma 3: each query head's RMSNorm weight [head_dim], and each key
    k_norm: torch.Tensor | None = None  # head's (Gemma's as it multiplies: 1 + its weight)


class Q4Weights:
    """A model's blocks from its GGUF, as the kernels read them (block_repack.py: Q4_1 or Q8_0): per layer the
    fused q/k/v, output, fused gate/up and down (with Qwen2's biases, Qwen3's and Gemma 3's q/k norms), the
    lm_head (the tied token embedding where there is no output.weight); `embedding`, an untied model's token
    embedding, looked up in the file (None where tied)."""

    def __init__(self, layers: list[Q4Layer], lm_head: QuantizedWeight, norms: dict[str, torch.Tensor],
                 embedding: "FileRows | None" = None):
        self.layers, self.lm_head, self.norms, self.embedding = layers, lm_head, norms, embedding
        self.mapped_bytes = 0  # of blocks mapped from the cache (block_cache.py)

    @staticmethod
    def layout_problem(path: str) -> str:
        """Why the kernels cannot compute `path`'s model ("" where they can): they run a Llama-shaped model whose
        projections and lm_head are of a type block_repack.py reads."""
        gguf = read_gguf(path)
        if gguf.architecture not in KERNEL_ARCHITECTURES:
            return f"the 4-bit kernels run {', '.join(KERNEL_ARCHITECTURES)} files, this one is {gguf.architecture}"
        for tensor in gguf.tensors.values():
            if len(tensor.shape) == 2 and tensor.type_name not in REPACKED:
                return f"the 4-bit kernels read {', '.join(REPACKED)}; {tensor.name} is {tensor.type_name}"
        return ""

    @classmethod
    def from_gguf(cls, path: str, config, kernels: "Q4Kernels | None" = None, cache_dir: str = "") -> "Q4Weights":
        """Raises ValueError for a GGUF whose tensors are not a Llama layout these kernels read. The tensors are
        read from the file in place (memory-mapped) and repacked here; with `kernels` and `cache_dir`, once, into
        the cache in the layout those kernels read (block_cache.py), and mapped from there."""
        gguf = read_gguf(path)
        store = None
        if kernels is not None and cache_dir:
            store = BlockCache(cache_dir, path, "interleaved" if kernels.interleaves else "plain",
                               kernels.interleaved)

        def cached(name: str, make) -> QuantizedWeight:
            return make() if store is None else store.weight(name, make)

        if gguf.architecture not in KERNEL_ARCHITECTURES:
            raise ValueError(f"the 4-bit kernels do not run {gguf.architecture} files")
        # convert_hf_to_gguf permutes llama's q/k rows only
        heads, kv_heads = (config.num_attention_heads, config.num_key_value_heads) if gguf.architecture == "llama" \
            else (0, 0)

        # Q4_0 and Q4_K kept as the file's blocks where the kernels read them interleaved (Q4_0_X8, Q4_K_X8)
        interleaves = kernels is not None and kernels.interleaves

        def blocks(name: str, permute_heads: int = 0) -> tuple[int, np.ndarray, int, int]:
            tensor = gguf.tensors.get(name)
            if tensor is None or len(tensor.shape) != 2:
                raise ValueError(f"{name}: missing or not a matrix")
            in_features, out_features = tensor.shape
            format_, data = kernel_blocks(tensor.type_name, gguf.tensor_data(name), out_features, kernels,
                                          interleaves)
            if permute_heads:  # convert_hf_to_gguf's q/k row permutation, undone (transformers' row order)
                data = data.reshape(permute_heads, out_features // permute_heads // 2, 2, -1) \
                    .swapaxes(1, 2).reshape(out_features, -1)
            return format_, data, out_features, in_features

        def weight(*parts: tuple[int, np.ndarray, int, int]) -> QuantizedWeight:
            """One weight of its parts' rows, in one format (block_repack.fused_parts: Q8_0 where they mix)."""
            chosen, data = fused_parts([(format_, data) for format_, data, _, _ in parts], kernels)
            data = np.concatenate(data) if len(data) > 1 else data[0]
            if not (data.flags.writeable and data.flags.c_contiguous):  # the file's own blocks, mapped read-only
                data = np.array(data, order="C")
            return QuantizedWeight(torch.from_numpy(data), chosen, sum(part[2] for part in parts), parts[0][3])

        def norm(name: str) -> torch.Tensor:
            """A norm's weight or a bias, as stored (float32, or dequantized)."""
            if name not in gguf.tensors or len(gguf.tensors[name].shape) != 1:
                raise ValueError(f"{name}: missing or not a vector")
            return torch.from_numpy(_dequantized_rows(gguf, name).reshape(-1))

        # Gemma's files hold its norms as they multiply (1 + w, convert_hf_to_gguf's shift); the model and its norm
        # modules take w, and the kernels 1 + w computed as the model computes it (the same float32 numbers)
        shift = 1.0 if gguf.architecture == "gemma3" else 0.0

        def multiplier(weight: torch.Tensor | None) -> torch.Tensor | None:
            return None if weight is None else weight + shift

        try:  # a failed write (a full disk, a tensor refused) leaves no partial cache behind
            layers, norms = [], {"model.norm.weight": norm("output_norm.weight") - shift}
            for i in range(config.num_hidden_layers):
                block, attention = f"blk.{i}.", f"model.layers.{i}.self_attn."
                extras = {}  # HF name -> values, for the model (give_model_the_same_weights) and the kernels alike
                if gguf.architecture == "qwen2":
                    extras.update({f"{attention}{p}_proj.bias": norm(f"{block}attn_{p}.bias") for p in "qkv"})
                if gguf.architecture in ("qwen3", "gemma3"):
                    extras.update({f"{attention}{p}_norm.weight": norm(f"{block}attn_{p}_norm.weight") - shift
                                   for p in "qk"})
                layers.append(Q4Layer(
                    qkv=cached(block + "qkv", lambda: weight(
                        blocks(block + "attn_q.weight", heads), blocks(block + "attn_k.weight", kv_heads),
                        blocks(block + "attn_v.weight"))),
                    out=cached(block + "out", lambda: weight(blocks(block + "attn_output.weight"))),
                    gate_up=cached(block + "gate_up", lambda: weight(blocks(block + "ffn_gate.weight"),
                                                                     blocks(block + "ffn_up.weight"))),
                    down=cached(block + "down", lambda: weight(blocks(block + "ffn_down.weight"))),
                    qkv_bias=torch.cat([extras[f"{attention}{p}_proj.bias"] for p in "qkv"]) if extras and
                    gguf.architecture == "qwen2" else None,
                    q_norm=multiplier(extras.get(f"{attention}q_norm.weight")),
                    k_norm=multiplier(extras.get(f"{attention}k_norm.weight"))))
                norms.update(extras)
                layer = f"model.layers.{i}."
                norms[layer + "input_layernorm.weight"] = norm(block + "attn_norm.weight") - shift
                if gguf.architecture == "gemma3":
                    norms[layer + "pre_feedforward_layernorm.weight"] = norm(block + "ffn_norm.weight") - shift
                    norms[layer + "post_attention_layernorm.weight"] = \
                        norm(block + "post_attention_norm.weight") - shift
                    norms[layer + "post_feedforward_layernorm.weight"] = norm(block + "post_ffw_norm.weight") - shift
                else:
                    norms[layer + "post_attention_layernorm.weight"] = norm(block + "ffn_norm.weight")
            untied = "output.weight" in gguf.tensors
            lm_head = cached("lm_head", lambda: weight(blocks("output.weight" if untied else "token_embd.weight")))
        except BaseException:
            if store is not None:
                store.abandon()
            raise
        if store is not None:
            store.commit()
        # looked up, never multiplied: the file's own values, dequantized
        weights = cls(layers, lm_head, norms, FileRows(gguf, "token_embd.weight") if untied else None)
        weights.mapped_bytes = store.size if store is not None else 0
        return weights

    def token_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The embedding of tokens `ids` [N] -> [N, hidden] float32: an untied file's own rows, else the tied
        lm_head's (the very blocks the logits are computed with)."""
        return (self.embedding or self.lm_head).rows(ids)

    @classmethod
    def of_embedded_model(cls, config, cache_dir: str = "") -> "Q4Weights":
        """The embedded default model's blocks."""
        from ..model_store import find_gguf

        return cls.from_gguf(str(find_gguf()), config)

    @torch.no_grad()
    def give_model_the_same_weights(self, model: nn.Module, projections: bool = True) -> None:
        """The model's own parameters become these blocks dequantized (float32): its forward, the reference of
        the tests, then computes with the very numbers the kernels read. `projections=False` where these kernels
        compute every step and every prompt: the model's float32 copies of its layers' projections, of its token
        embedding (`token_rows` looks tokens up in the blocks) and of an untied lm_head would never be read, so they
        are released instead (the embedded model's 405 + 113 MB, a Llama 3 8 B's 30 GB); the norms are given as
        ever."""
        if model.dtype != torch.float32:
            raise ValueError("the 4-bit kernels run beside a float32 model")
        if not projections:
            _release_projections(model)
        parameters, written = dict(model.named_parameters()), set()

        def write(parameter: torch.Tensor, value: torch.Tensor) -> None:
            _copy_into(parameter, value)
            written.add(id(parameter))

        for name, value in self.norms.items():
            write(parameters[name], value)
        for i, layer in enumerate(self.layers if projections else ()):
            prefix = f"model.layers.{i}."
            attention, mlp = prefix + "self_attn.", prefix + "mlp."
            qkv, gate_up = layer.qkv.dequantized(), layer.gate_up.dequantized()
            sizes = [parameters[attention + p + "_proj.weight"].shape[0] for p in "qkv"]
            for part, value in zip("qkv", qkv.split(sizes)):
                write(parameters[attention + part + "_proj.weight"], value)
            gate, up = gate_up.chunk(2)
            write(parameters[mlp + "gate_proj.weight"], gate)
            write(parameters[mlp + "up_proj.weight"], up)
            write(parameters[attention + "o_proj.weight"], layer.out.dequantized())
            write(parameters[mlp + "down_proj.weight"], layer.down.dequantized())
        if projections:
            write(model.get_input_embeddings().weight, (self.embedding or self.lm_head).dequantized())
        if projections and _has_own_lm_head(model):
            write(model.lm_head.weight, self.lm_head.dequantized())
        unwritten = [name for name, parameter in parameters.items()
                     if parameter.numel() and id(parameter) not in written]
        if unwritten:  # an empty_model's would hold whatever its memory held
            raise ValueError(f"the GGUF gives no values for {', '.join(unwritten[:3])}")


def _release_projections(model: nn.Module) -> None:
    modules = [module for layer in model.model.layers
               for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                              layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    modules += [model.get_input_embeddings(), model.lm_head]
    released = sum(weight.numel() * weight.element_size()
                   for weight in {id(m.weight): m.weight for m in modules}.values())
    for module in modules:
        module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
    release_freed_memory()
    logger.info("the model's float32 copies of its projections and embedding released (the 4-bit kernels compute "
                "every step and prompt on the blocks): %.0f MB", released / 2**20)


def _has_own_lm_head(model: nn.Module) -> bool:
    return model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()  # not tied


def _copy_into(parameter: torch.Tensor, value: torch.Tensor) -> None:
    if parameter.shape != value.shape:
        raise ValueError(f"a GGUF weight of shape {tuple(value.shape)} for a parameter of {tuple(parameter.shape)}")
    parameter.copy_(value)


class Q4Stack:
    """The weights as `Q4Kernels.forward` reads them (pointers into tensors it keeps)."""

    def __init__(self, weights: Q4Weights, input_norms: list[torch.Tensor], post_norms: list[torch.Tensor],
                 epsilons: list[float], final_norm: torch.Tensor, config, kernels: Q4Kernels,
                 output_norms: list[tuple[torch.Tensor, torch.Tensor]] | None = None):
        """`post_norms`: the norms before each FFN; `output_norms`: Gemma 3's norms of each attention's and FFN's
        output. Norms as they multiply (Gemma's 1 + w)."""
        self.num_layers = len(weights.layers)
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.hidden = config.hidden_size
        self.intermediate = weights.layers[0].gate_up.out_features // 2
        self.vocabulary = weights.lm_head.out_features
        self.scaling = (getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        activation = activation_of(config)
        if activation not in ACTIVATIONS:
            raise ValueError(f"the 4-bit decode step cannot run this model: its activation is {activation}")
        self.activation = ACTIVATIONS[activation]
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * len(weights.layers)
        windows = [config.sliding_window if kind == "sliding_attention" else 0 for kind in layer_types]
        self.windows = (ctypes.c_int64 * len(windows))(*windows) if any(windows) else None
        expected = {"qkv": ((self.num_heads + 2 * self.num_kv_heads) * self.head_dim, self.hidden),
                    "out": (self.hidden, self.num_heads * self.head_dim),
                    "gate_up": (2 * self.intermediate, self.hidden), "down": (self.hidden, self.intermediate)}
        if self.num_layers == 0 or self.num_heads % self.num_kv_heads or self.head_dim % 8 \
                or self.num_heads // self.num_kv_heads > 8 or self.hidden % BLOCK or self.intermediate % BLOCK \
                or any((getattr(layer, name).out_features, getattr(layer, name).in_features) != dims
                       or getattr(layer, name).format not in PLAIN.keys() | INTERLEAVED.keys()
                       for layer in weights.layers for name, dims in expected.items()) \
                or weights.lm_head.in_features != self.hidden:
            raise ValueError("the 4-bit decode step cannot run this model: shapes it does not take")
        norms = [n.detach().float().contiguous() for n in (*input_norms, *post_norms, final_norm)]
        # the interleaved copies replace the plain blocks (which `weights` keeps only as long as the caller does)
        layers = [[kernels.interleaved(w) for w in (layer.qkv, layer.out, layer.gate_up, layer.down)]
                  for layer in weights.layers]
        self.layer_formats = tuple(w.format for layer in layers for w in layer)  # 4 per layer (q4_kernels.c)
        self.formats = (ctypes.c_int64 * len(self.layer_formats))(*self.layer_formats)
        lm_head = kernels.interleaved(weights.lm_head)
        self.lm_head_format = lm_head.format
        tensors: list[torch.Tensor | None] = []  # q4_kernels.c's WEIGHTS_PER_LAYER a layer; None: NULL
        output_norms = output_norms or [(None, None)] * self.num_layers
        for i, ((qkv, out, gate_up, down), layer) in enumerate(zip(layers, weights.layers)):
            extras = [None if t is None else t.detach().float().contiguous()
                      for t in (layer.qkv_bias, layer.q_norm, layer.k_norm, *output_norms[i])]
            if (extras[1] is None) != (extras[2] is None) or any(
                    t is not None and t.shape != (width,) for t, width in zip(
                        extras, (expected["qkv"][0], self.head_dim, self.head_dim, self.hidden, self.hidden))):
                raise ValueError("the 4-bit decode step cannot run this model: a bias or q/k norm of another shape")
            tensors += [norms[i], qkv.blocks, out.blocks, norms[self.num_layers + i], gate_up.blocks, down.blocks,
                        *extras]
        tensors += [norms[-1], lm_head.blocks]
        self._tensors = tensors
        self.pointers = (ctypes.c_void_p * len(tensors))(*(None if t is None else t.data_ptr() for t in tensors))
        self.eps = (ctypes.c_float * len(epsilons))(*epsilons)


def _repacked(function, data: np.ndarray, in_bytes: int, out_bytes: int) -> tuple[int | None, np.ndarray]:
    """(the C function's result, its output) for rows of blocks of `in_bytes` each written as `out_bytes`."""
    data = np.ascontiguousarray(data, dtype=np.uint8)
    out = np.empty((data.shape[0], data.shape[1] // in_bytes * out_bytes), dtype=np.uint8)
    return function(data.ctypes.data, data.size // in_bytes, out.ctypes.data), out


def _interleaved_positions(format_: int) -> np.ndarray:
    """[8, row's block bytes]: where byte i of row j's block lies in its group of 8 rows (lockstep_q4_interleave's
    layout: the 8 rows' d, then their m for Q4_1, then vectors of 32 bytes, vector v holding bytes 4v..4v+3 of each
    row). Q4_K_X8's row j reads as d, dmin, its 8 scales, its 8 minimums, then 8 blocks of 16 bytes of nibbles;
    Q6_K_X8's as d, its 16 scales, then per block 16 bytes of nibbles and 4 and 4 bytes of the high bits' planes."""
    positions = np.empty((8, block_shape(format_)[1]), dtype=np.int64)
    for j in range(8):
        if format_ == FORMAT_Q6_K_X8:
            blocks = [[144 + 192 * b + 32 * (i // 4) + 4 * j + i % 4 for i in range(16)]
                      + [144 + 192 * b + plane + 4 * j + t for plane in (128, 160) for t in range(4)] for b in range(8)]
            positions[j] = [2 * j, 2 * j + 1, *(16 + 8 * s + j for s in range(16)), *sum(blocks, [])]
            continue
        if format_ == FORMAT_Q4_K_X8:
            nibbles = [160 + 128 * s + 32 * (i // 4) + 4 * j + i % 4 for s in range(8) for i in range(16)]
            positions[j] = [2 * j, 2 * j + 1, 16 + 2 * j, 17 + 2 * j, *(32 + 8 * s + j for s in range(8)),
                            *(96 + 8 * s + j for s in range(8)), *nibbles]
            continue
        header = 4 if format_ == FORMAT_Q4_1_X8 else 2
        quants = [8 * header + 32 * (i // 4) + 4 * j + i % 4 for i in range(BLOCK_BYTES[format_] - header)]
        positions[j] = [2 * j, 2 * j + 1, *([16 + 2 * j, 17 + 2 * j] if header == 4 else []), *quants]
    return positions


def _dequantized_blocks(raw: np.ndarray, format_: int) -> np.ndarray:
    """Blocks [rows, blocks, bytes] of a row as `rows` reads them (Q4_0_X8's: d, nibbles; Q4_K_X8's: see
    _interleaved_positions), in float32 as gguf-py computes them: d q + m (q4_kernels.c's FMA gives the same, d q
    being exact)."""
    def half(at: int) -> np.ndarray:
        return raw[..., at:at + 2].copy().view(np.float16).astype(np.float32)

    def nibbles(at: int) -> np.ndarray:  # Q4_1's order: value i in byte i's low nibble, i + 16 in its high one
        packed = raw[..., at:].reshape(*raw.shape[:-1], -1, 16)
        return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.float32)  # [..., blocks, 32]

    if format_ == FORMAT_Q4_1:
        return half(0) * nibbles(4)[..., 0, :] + half(2)
    if format_ == FORMAT_Q4_0:
        d = half(0)
        return d * nibbles(2)[..., 0, :] + d * np.float32(-8)
    if format_ == FORMAT_Q6_K:  # (d sc) (q - 32), 16 values by 16
        shape = raw.shape[:-1]
        blocks = raw[..., 18:].reshape(*shape, 8, 24)  # per block: 16 bytes of nibbles, two planes of 4
        low = np.concatenate([blocks[..., :16] & 0x0F, blocks[..., :16] >> 4], axis=-1)
        shifts = (2 * (np.arange(16) // 4)).astype(np.uint8)  # value i's bits in byte i % 4 of its plane
        planes = [(blocks[..., 16 + 4 * p:20 + 4 * p][..., np.arange(16) % 4] >> shifts) & 3 for p in (0, 1)]
        q = (low | (np.concatenate(planes, axis=-1) << 4)).astype(np.float32) - np.float32(32)  # [..., 8, 32]
        scales = half(0) * raw[..., 2:18].copy().view(np.int8).astype(np.float32)  # [..., 16]
        return (scales.reshape(*shape, 8, 2, 1) * q.reshape(*shape, 8, 2, 16)).reshape(*shape, 256)
    if format_ == FORMAT_Q4_K:  # (d sc) q - dmin m, sub-block by sub-block
        scales, minimums = raw[..., 4:12].astype(np.float32), raw[..., 12:20].astype(np.float32)
        return (half(0) * scales)[..., None] * nibbles(20) - (half(2) * minimums)[..., None]
    return half(0) * raw[..., 2:].copy().view(np.int8).astype(np.float32)


class FileRows:
    """An untied token embedding looked up in the mapped file: the rows asked for, dequantized (the file's own
    numbers, gguf-py's), so the table is never held in float32 (2.1 GB for a Llama 3 8 B)."""

    def __init__(self, gguf: GGUFFile, name: str):
        self.gguf, self.name = gguf, name
        self.type = gguf.tensors[name].type_name
        self.out_features, self.in_features = gguf.tensors[name].shape[::-1]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf import GGMLQuantizationType, quants

        ids = ids.to(torch.int64).reshape(-1).numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.out_features):
            raise IndexError("token id outside the vocabulary")
        data = self.gguf.tensor_data(self.name)[ids]
        values = quants.dequantize(data, GGMLQuantizationType[self.type])
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(len(ids), self.in_features))

    def dequantized(self) -> torch.Tensor:
        return torch.from_numpy(_dequantized_rows(self.gguf, self.name))


def _dequantized_rows(gguf: GGUFFile, name: str) -> np.ndarray:
    tensor = gguf.tensors[name]
    values = dequantized(gguf.tensor_data(name), tensor.type_name)
    # A copy even of F32 values, which come as a read-only view of the mapped file; GGML's order: innermost first.
    return np.array(values, dtype=np.float32, order="C").reshape(tensor.shape[::-1])


def _random_blocks(generator: np.random.Generator, fmt: int, rows: int, depth: int) -> torch.Tensor:
    """Random blocks of a plain format, their (first two) fp16 scales of about 0.05 (Q4_K: 0.05 / 63; Q6_K's one d,
    at its end: 0.05 / 2048)."""
    values, size = block_shape(fmt)
    blocks = generator.integers(0, 256, (rows, depth // values, size), dtype=np.uint8)
    if fmt == FORMAT_Q6_K:
        d = generator.standard_normal((rows, depth // values, 1)) * (0.05 / 2048)
        blocks[..., 208:210] = d.astype(np.float16).view(np.uint8).reshape(rows, depth // values, 2)
        return torch.from_numpy(blocks.reshape(rows, -1))
    scales = (generator.standard_normal((rows, depth // values, 2)) * (0.05 / 63 if fmt == FORMAT_Q4_K else 0.05))
    blocks[..., 0:4] = scales.astype(np.float16).view(np.uint8).reshape(rows, depth // values, 4)
    return torch.from_numpy(blocks.reshape(rows, -1))


def _is_f32_cpu(*tensors: torch.Tensor) -> bool:
    return _is_cpu_contiguous(torch.float32, *tensors)


def _is_cpu_contiguous(dtype: torch.dtype, *tensors: torch.Tensor) -> bool:
    return all(tensor.dtype == dtype and tensor.device.type == "cpu" and tensor.is_contiguous() for tensor in tensors)


def load_q4_kernels(cache_dir: str, helpers: int, exact: bool = False) -> Q4Kernels | None:
    """The kernels (`exact`: on float32 activations), built into `cache_dir`/kernels if they are not there yet;
    None (and why, in the log) where they cannot run here."""
    compiler = find_compiler()
    if compiler is None:
        logger.info("4-bit kernels: no C compiler (cc, gcc or $CC)")
        return None
    try:
        # -march=native code for one CPU may not run on another that shares the cache folder: the flags are the key
        library = ctypes.CDLL(str(built_library(SOURCE, Path(cache_dir) / "kernels", compiler, compile_flags(),
                                                LINK_FLAGS, key=" ".join(sorted(cpu_flags())))))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("4-bit kernels: could not build or load them (%s)", exc)
        return None
    kernels = Q4Kernels(library, helpers, exact)
    if not kernels.computes_correctly():
        logger.warning("4-bit kernels: their probe computed wrong numbers")
        return None
    return kernels


def compile_flags() -> tuple[str, ...]:
    """-O3 for this CPU, less what the capability mask hides; -ffp-contract=off: no FMA where the source says
    multiply, then add (the weights dequantize as gguf-py's)."""
    if platform.machine() in ("aarch64", "arm64"):
        # the compiler may still use what the mask hides in its vectorized loops
        hidden = tuple(flag for name, flag in MASKABLE_ARM64.items() if name not in cpu_flags())
        return "-O3", "-mcpu=native", *hidden, "-ffp-contract=off", "-shared", "-fPIC"
    hidden = tuple(flag for name, flag in MASKABLE_X86.items() if name not in cpu_flags())
    return "-O3", "-march=native", *hidden, "-ffp-contract=off", "-shared", "-fPIC"

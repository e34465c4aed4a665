"""lockstep's C kernels for a bfloat16 decode step (bf16_kernels.c: the weight matmuls, the decode attention,
RMSNorm, SwiGLU, and a whole decode step in one call, its matmuls shared with a helper thread), built on first use
with the system's C compiler into the cache folder and loaded with ctypes.

They are used only where they can run and compute what they should: an x86 CPU with AVX512-BF16, a C compiler,
and probes against float64 when they load. Otherwise `load_bf16_kernels` says why in the log and returns None, and
the fast forward keeps oneDNN's matmuls. Nothing here runs at import time.
"""
import ctypes
import logging
import mmap
import subprocess
from dataclasses import dataclass
from pathlib import Path

import torch

from ..hardware import cpu_flags
from .c_build import built_library, find_compiler

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bf16_kernels.c")
COMPILE_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-shared", "-fPIC")
LINK_FLAGS = ("-lm", "-pthread")
CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})  # what those flags let it execute
PROBE_ROWS = 33
HUGE_PAGE_BYTES = 2 * 2**20
ARENA_CHUNK_BYTES = 64 * 2**20  # packed weights are carved from regions of this size (the lm_head gets its own)


class Bf16Kernels:
    """`pack` a weight [N, K] once, then `linear(x, packed)` computes x @ weight.T, bfloat16 in and out;
    `decode_attention` attends one query token per row over the slot cache."""

    def __init__(self, library: ctypes.CDLL):
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        self._linear = library.lockstep_bf16_linear
        self._linear.argtypes = [pointer, pointer, pointer, size, size, size]
        self._linear.restype = None
        self._attention = library.lockstep_bf16_decode_attention
        self._attention.argtypes = [pointer, pointer, pointer, pointer, pointer, size, size, size, size, size,
                                    ctypes.c_float, pointer]
        self._attention.restype = None
        self._rms_norm = library.lockstep_bf16_rms_norm
        self._rms_norm.argtypes = [pointer, pointer, pointer, size, size, ctypes.c_float]
        self._rms_norm.restype = None
        self._silu_mul = library.lockstep_bf16_silu_mul
        self._silu_mul.argtypes = [pointer, pointer, size, size]
        self._silu_mul.restype = None
        self._decode_step = library.lockstep_bf16_decode_step
        self._decode_step.argtypes = [pointer, size, pointer, pointer, pointer, pointer, pointer, size, pointer,
                                      pointer, pointer, ctypes.c_float, pointer, ctypes.c_int]
        self._decode_step.restype = ctypes.c_int
        self.columns_per_block = library.lockstep_bf16_columns_per_block()
        self._arena = _HugePageArena()

    def supports(self, weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
                and weight.shape[0] % self.columns_per_block == 0 and weight.shape[1] % 2 == 0)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] -> [N / columns, K / 2, columns, 2]: the layout bf16_kernels.c streams through, in memory that
        Linux may back with 2 MB pages (`_HugePageArena`)."""
        rows, depth = weight.shape
        blocks = (weight.detach().reshape(rows // self.columns_per_block, self.columns_per_block, depth // 2, 2)
                  .permute(0, 2, 1, 3))
        packed = self._arena.take(blocks.numel() * blocks.element_size()).view(weight.dtype).view(blocks.shape)
        return packed.copy_(blocks)

    def linear(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        depth = packed.shape[1] * 2
        out_features = packed.shape[0] * self.columns_per_block
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != depth:
            raise ValueError(f"this matmul takes bfloat16 CPU inputs of {depth} features, not {tuple(x.shape)} "
                             f"{x.dtype} on {x.device}")
        rows = x.reshape(-1, depth).contiguous()
        out = torch.empty((rows.shape[0], out_features), dtype=torch.bfloat16)
        self._linear(rows.data_ptr(), packed.data_ptr(), out.data_ptr(), rows.shape[0], out_features, depth)
        return out.view(*x.shape[:-1], out_features)

    @staticmethod
    def supports_attention(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
        return head_dim % 32 == 0 and head_dim <= 256 and num_heads % num_kv_heads == 0 \
            and num_heads // num_kv_heads <= 8

    def decode_attention(self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                         scaling: float) -> torch.Tensor:
        """query [B, heads, head_dim]; keys and values: the cache's slots [>= B, kv_heads, capacity, head_dim],
        row r reading slot r; lengths [B] (int64): row r attends to its positions 0..lengths[r]-1.
        Returns [B, heads, head_dim]."""
        rows, num_heads, head_dim = query.shape
        _, num_kv_heads, capacity, _ = keys.shape
        for name, tensor in (("query", query), ("keys", keys), ("values", values)):
            if not _is_bf16_cpu(tensor):
                raise ValueError(f"decode attention takes contiguous bfloat16 CPU tensors; {name} is not")
        if keys.shape != values.shape or keys.shape[0] < rows or keys.shape[3] != head_dim \
                or lengths.dtype != torch.int64 or lengths.shape != (rows,) \
                or not self.supports_attention(num_heads, num_kv_heads, head_dim):
            raise ValueError("decode attention: shapes that do not fit together")
        if rows and not bool(((lengths >= 1) & (lengths <= capacity)).all()):
            raise ValueError("decode attention: a length outside 1..capacity")
        group = num_heads // num_kv_heads
        out = torch.empty_like(query)
        scratch = torch.empty(capacity + group * (capacity // 2 + 1), dtype=torch.float32)
        lengths = lengths.contiguous()
        self._attention(query.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), lengths.data_ptr(),
                        rows, num_kv_heads, group, capacity, head_dim, scaling, scratch.data_ptr())
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """transformers' LlamaRMSNorm of x [..., hidden] (bfloat16; weight [hidden])."""
        hidden = weight.shape[0]
        if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or not weight.is_contiguous() \
                or x.device.type != "cpu" or weight.device.type != "cpu" or x.shape[-1] != hidden:
            raise ValueError(f"rms_norm takes bfloat16 CPU inputs of {hidden} features and a contiguous bfloat16 "
                             "weight")
        rows = x.reshape(-1, hidden).contiguous()
        out = torch.empty_like(rows)
        self._rms_norm(rows.data_ptr(), weight.data_ptr(), out.data_ptr(), rows.shape[0], hidden, eps)
        return out.view(x.shape)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up [..., 2 * intermediate] (gate first), as torch computes it on bfloat16."""
        width = gate_up.shape[-1]
        if gate_up.dtype != torch.bfloat16 or gate_up.device.type != "cpu" or width % 32:
            raise ValueError("silu_mul takes bfloat16 CPU inputs of a width that is a multiple of 32")
        rows = gate_up.reshape(-1, width).contiguous()
        out = torch.empty((rows.shape[0], width // 2), dtype=torch.bfloat16)
        self._silu_mul(rows.data_ptr(), out.data_ptr(), rows.shape[0], width // 2)
        return out.view(*gate_up.shape[:-1], width // 2)

    def decode_step(self, stack: "DecoderStack", hidden: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                    share_matmuls: bool = False) -> torch.Tensor:
        """One decode step through every layer of `stack`, its final norm and lm_head: the logits [rows,
        vocabulary] of hidden [rows, hidden] (bfloat16, the embedded tokens; overwritten). Row r feeds position
        positions[r] (int64) of slot r of each layer's keys and values [slots, kv_heads, capacity, head_dim],
        rotated by cos and sin [rows, head_dim]. `share_matmuls`: with the kernels' helper thread (the second
        core; for steps of few rows, which are bound by reading the weights)."""
        rows = hidden.shape[0]
        if not (_is_bf16_cpu(hidden, cos, sin) and hidden.shape == (rows, stack.hidden)
                and cos.shape == sin.shape == (rows, stack.head_dim)):
            raise ValueError("decode_step: hidden states or rotary tables of the wrong shape or kind")
        if len(keys) != stack.num_layers or len(values) != stack.num_layers or not _is_bf16_cpu(*keys, *values):
            raise ValueError("decode_step: one contiguous bfloat16 slot cache per layer")
        slots, num_kv_heads, capacity, head_dim = keys[0].shape
        if slots < rows or (num_kv_heads, head_dim) != (stack.num_kv_heads, stack.head_dim) \
                or any(tensor.shape != keys[0].shape for tensor in (*keys, *values)):
            raise ValueError("decode_step: slot caches that do not fit the model or the rows")
        if positions.dtype != torch.int64 or positions.shape != (rows,) \
                or (rows and not bool(((positions >= 0) & (positions < capacity)).all())):
            raise ValueError("decode_step: a position outside the slots' capacity")
        dims = (ctypes.c_int64 * 7)(stack.hidden, stack.num_heads, stack.num_kv_heads, stack.head_dim,
                                    stack.intermediate, capacity, stack.vocabulary)
        key_pointers = (ctypes.c_void_p * stack.num_layers)(*(tensor.data_ptr() for tensor in keys))
        value_pointers = (ctypes.c_void_p * stack.num_layers)(*(tensor.data_ptr() for tensor in values))
        positions = positions.contiguous()
        logits = torch.empty((rows, stack.vocabulary), dtype=torch.bfloat16)
        if self._decode_step(dims, stack.num_layers, stack.weights, stack.eps, key_pointers, value_pointers,
                             hidden.data_ptr(), rows, positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                             stack.scaling, logits.data_ptr(), int(share_matmuls)):
            raise MemoryError("decode_step: no memory for the step's scratch buffers")
        return logits

    def computes_correctly(self) -> bool:
        return (self._linear_computes_correctly() and self._attention_computes_correctly()
                and self._rms_norm_computes_correctly() and self._silu_mul_computes_correctly())

    def _silu_mul_computes_correctly(self) -> bool:
        """A probe against float64: silu(gate) * up within two bfloat16 roundings, and each row the same alone."""
        generator = torch.Generator().manual_seed(0)
        gate_up = (torch.randn(3, 64, generator=generator) * 4).to(torch.bfloat16)
        together = self.silu_mul(gate_up)
        gate, up = gate_up.double().chunk(2, dim=-1)
        exact = torch.nn.functional.silu(gate) * up
        close = bool(((together.double() - exact).abs() <= exact.abs() * 2 ** -7 + 1e-30).all())
        return close and all(torch.equal(self.silu_mul(gate_up[row]), together[row]) for row in range(3))

    def _rms_norm_computes_correctly(self) -> bool:
        """A probe against transformers' formula: within one bfloat16 rounding, and each row the same alone."""
        generator = torch.Generator().manual_seed(0)
        x = (torch.randn(9, 200, generator=generator) * 3).to(torch.bfloat16)  # 200: a ragged last vector
        weight = torch.randn(200, generator=generator).to(torch.bfloat16)
        together = self.rms_norm(x, weight, 1e-5)
        exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5) * weight.double()
        close = bool(((together.double() - exact).abs() <= exact.abs() * 2 ** -6 + 1e-6).all())
        return close and all(torch.equal(self.rms_norm(x[row], weight, 1e-5), together[row]) for row in range(9))

    def _attention_computes_correctly(self) -> bool:
        """A probe against float64 attention: within bfloat16's rounding, and each row the same alone."""
        generator = torch.Generator().manual_seed(0)
        rows, num_kv_heads, group, capacity, head_dim = 5, 2, 3, 40, 64
        query = torch.randn(rows, num_kv_heads * group, head_dim, generator=generator).to(torch.bfloat16)
        keys, values = (torch.randn(rows, num_kv_heads, capacity, head_dim, generator=generator).to(torch.bfloat16)
                        for _ in range(2))
        lengths = torch.tensor([1, 17, 40, 16, 33])
        together = self.decode_attention(query, keys, values, lengths, head_dim ** -0.5)
        for row in range(rows):
            length = int(lengths[row])
            grouped = query[row].double().view(num_kv_heads, group, head_dim)
            scores = grouped @ keys[row, :, :length].double().transpose(1, 2) * head_dim ** -0.5
            weights, row_values = torch.softmax(scores, dim=-1), values[row, :, :length].double()
            exact = (weights @ row_values).view(-1, head_dim)
            # the weights are rounded to bfloat16 (as the torch path rounds them), then the result
            bound = (weights @ row_values.abs()).view(-1, head_dim) * 2 ** -7 + exact.abs() * 2 ** -8 + 1e-6
            if not ((together[row].double() - exact).abs() <= bound).all():
                return False
            alone = self.decode_attention(query[row:row + 1].contiguous(), keys[row:row + 1].contiguous(),
                                          values[row:row + 1].contiguous(), lengths[row:row + 1], head_dim ** -0.5)
            if not torch.equal(alone[0], together[row]):
                return False
        return True

    def _linear_computes_correctly(self) -> bool:
        """A probe: within bfloat16's rounding of the float64 result, and each row the same alone as among
        others (the property the engine's batch invariance rests on)."""
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(2 * self.columns_per_block, 160, generator=generator).to(torch.bfloat16)
        x = torch.randn(PROBE_ROWS, 160, generator=generator).to(torch.bfloat16)
        packed = self.pack(weight)
        together = self.linear(x, packed)
        exact = x.double() @ weight.double().T
        bound = exact.abs() * 2 ** -8 + (x.double().abs() @ weight.double().abs().T) * 2 ** -20
        close = bool(((together.double() - exact).abs() <= bound).all())
        alone = all(torch.equal(self.linear(x[row:row + 1], packed), together[row:row + 1])
                    for row in range(PROBE_ROWS))
        return close and alone


@dataclass(frozen=True)
class LayerWeights:
    """One Llama-shaped decoder layer for `DecoderStack`: the norms' weights, the packed matmul weights."""
    input_norm: torch.Tensor
    input_eps: float
    qkv: torch.Tensor
    out: torch.Tensor
    post_norm: torch.Tensor
    post_eps: float
    gate_up: torch.Tensor
    down: torch.Tensor


class DecoderStack:
    """A model's weights as `Bf16Kernels.decode_step` reads them (pointers into tensors it keeps): every decoder
    layer's, the final norm's and the packed lm_head."""

    def __init__(self, kernels: Bf16Kernels, layers: list[LayerWeights], final_norm: torch.Tensor, final_eps: float,
                 lm_head: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
        if not layers:
            raise ValueError("decode_step cannot run this model: no layers")
        columns = kernels.columns_per_block
        self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = len(layers), num_heads, num_kv_heads, \
            head_dim
        self.hidden = final_norm.shape[0]
        self.intermediate = (_packed_dims(layers[0].gate_up, columns) or (0,))[0] // 2
        self.vocabulary = (_packed_dims(lm_head, columns) or (0,))[0]
        self.scaling = head_dim ** -0.5
        expected = {"qkv": ((num_heads + 2 * num_kv_heads) * head_dim, self.hidden),
                    "out": (self.hidden, num_heads * head_dim), "gate_up": (2 * self.intermediate, self.hidden),
                    "down": (self.hidden, self.intermediate)}
        if not (kernels.supports_attention(num_heads, num_kv_heads, head_dim) and self.hidden % 32 == 0
                and (num_heads * head_dim) % 32 == 0 and self.intermediate % 16 == 0
                and all(_is_bf16_cpu(layer.input_norm, layer.post_norm, *(getattr(layer, name) for name in expected))
                        and layer.input_norm.shape == layer.post_norm.shape == (self.hidden,)
                        and all(_packed_dims(getattr(layer, name), columns) == dims for name, dims in expected.items())
                        for layer in layers)
                and _is_bf16_cpu(final_norm, lm_head) and final_norm.dim() == 1
                and _packed_dims(lm_head, columns) == (self.vocabulary, self.hidden)):
            raise ValueError("decode_step cannot run this model: shapes it does not take")
        tensors = [tensor for layer in layers for tensor in (layer.input_norm, layer.qkv, layer.out,
                                                              layer.post_norm, layer.gate_up, layer.down)]
        tensors += [final_norm, lm_head]
        self._tensors = tensors  # what the pointers below point into
        self.weights = (ctypes.c_void_p * len(tensors))(*(tensor.data_ptr() for tensor in tensors))
        epsilons = [eps for layer in layers for eps in (layer.input_eps, layer.post_eps)] + [final_eps]
        self.eps = (ctypes.c_float * len(epsilons))(*epsilons)


def _packed_dims(packed: torch.Tensor, columns: int) -> tuple[int, ...]:
    """(N, K) of a weight packed by `Bf16Kernels.pack`, [N / columns, K / 2, columns, 2]; () if it is not one."""
    if packed.dim() != 4 or tuple(packed.shape[2:]) != (columns, 2):
        return ()
    return packed.shape[0] * columns, packed.shape[1] * 2


def _is_bf16_cpu(*tensors: torch.Tensor) -> bool:
    return all(tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu" and tensor.is_contiguous()
               for tensor in tensors)


class _HugePageArena:
    """Memory for packed weights that Linux may back with 2 MB pages (transparent huge pages on request, the
    default mode): every decode step streams all the weights, and through 4 KB pages the core reads them more
    slowly (docs/benchmarks.md). Where huge pages are not offered, it is plain memory."""

    def __init__(self):
        self._free = torch.empty(0, dtype=torch.uint8)

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` bytes (a uint8 tensor), aligned to 64 bytes."""
        aligned = -(-nbytes // 64) * 64
        if self._free.numel() < aligned:
            self._free = _huge_page_region(max(ARENA_CHUNK_BYTES, aligned))
        taken, self._free = self._free[:nbytes], self._free[aligned:]
        return taken


def _huge_page_region(nbytes: int) -> torch.Tensor:
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:  # a kernel without transparent huge pages
        logger.debug("madvise(MADV_HUGEPAGE): %s", exc)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping until the last view of it is gone
    start = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[start:start + nbytes]


def load_bf16_kernels(cache_dir: str) -> Bf16Kernels | None:
    """The kernels, built into `cache_dir`/kernels if they are not there yet; None (and why, in the log) where
    they cannot run here."""
    missing = CPU_FLAGS - _cpu_flags()
    if missing:
        logger.info("bf16 kernels: this CPU lacks %s; oneDNN's matmuls", ", ".join(sorted(missing)))
        return None
    compiler = find_compiler()
    if compiler is None:
        logger.info("bf16 kernels: no C compiler (cc, gcc or $CC); oneDNN's matmuls")
        return None
    try:
        library = ctypes.CDLL(str(built_library(SOURCE, Path(cache_dir) / "kernels", compiler, COMPILE_FLAGS,
                                                LINK_FLAGS)))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("bf16 kernels: could not build or load them (%s); oneDNN's matmuls", exc)
        return None
    kernels = Bf16Kernels(library)
    if not kernels.computes_correctly():
        logger.warning("bf16 kernels: their probe computed wrong numbers; oneDNN's matmuls")
        return None
    return kernels


def _cpu_flags() -> set[str]:
    return set(cpu_flags())

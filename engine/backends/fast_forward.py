"""The transformers backend's forward for Llama-shaped models, decode steps and prompt chunks, with less around
it than transformers' forward, on one of two kinds of kernels:

- lockstep's C kernels (bf16.py, bf16_kernels.c), where they run: bfloat16, one torch thread, a CPU with
  AVX512-BF16 and a C compiler. Each streams its data once and computes every row the same way whatever else the
  step holds; a decode step is one C call (every layer, the final norm, the lm_head). The numbers differ from
  transformers' by rounding only (tests/backends/test_bf16_kernels.py: as close to float32 as oneDNN's).
- oneDNN elsewhere: the same arithmetic as transformers' forward, bit for bit (tests/backends/test_fast_forward.py), each
  weight reordered once into oneDNN's blocked layout (read much faster than the plain one: docs/benchmarks.md)
  where that gives the plain matmul's numbers bit for bit.

On a GGUF file's own blocks (q4.py, `FastDecoder(model, q4=...)`: llama, qwen2, qwen3 and gemma3 files, the
embedded model's among them), decode steps and prompt chunks are each one call of lockstep's 4-bit kernels, which
compute a chunk as decode steps (the same bits) and every row alike.

Otherwise, this forward fuses the q/k/v projections into one matmul and gate/up into another (fewer calls a step).
The fused weights are the storage: the model's own weights become views of them, so its forward (kept for other
models and the fallbacks) reads the same numbers. Each layer runs as a flat sequence of tensor ops: decode steps on
the slot KV cache (kv_cache.py), prompt chunks on the prompt's own DynamicCache with transformers' SDPA attention
and the model's own masks. On oneDNN every other op is the one transformers runs, in the same order and dtypes, so
a row's result does not depend on the other rows and batch invariance holds (tests/backends/test_batch_invariance.py).

Used for bfloat16 on CPU (in float32, MKL computes one row differently from several, and a fused weight
differently from its parts, so fusing would change the numbers there). Models this does not understand (biases,
other activations or norms, no rotary module) keep the model's forward too.
"""
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import nn
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .bf16 import PROBE_ROWS, Bf16Kernels, DecoderStack, LayerWeights
from .kv_cache import RowKVCache, SlotKVCache, one_query_attention
from .q4 import ACTIVATIONS, PromptCache, Q4Kernels, Q4Stack, Q4Weights, SlotTables, activation_of

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = {"llama", "mistral"}  # pre-norm, RMSNorm, rotary, SwiGLU, no biases: LlamaDecoderLayer
# q4_kernels.c adds q/k/v biases and q/k norms, and Gemma 3's GeGLU, output norms, windows and local rotary
Q4_MODEL_TYPES = SUPPORTED_MODEL_TYPES | {"qwen2", "qwen3", "gemma3_text"}
PACK_BATCH_HINT = 16  # oneDNN picks the blocked layout for about this many rows (1..64 measured alike)
# Up to this many rows (a decode step's) a fused weight's matmul is used where it was probed to give its parts'
# numbers; prompt chunks compute each part apart: on AMX, oneDNN blocks a 960-column bfloat16 matmul of ~200+
# rows otherwise than its 576- and 192-column parts (measured), and the model's forward computes the parts.
FUSED_MAX_ROWS = 64


class Linear:
    """`x @ weight.T`: lockstep's one-core kernel where it was given the kernels and they take this weight
    (bf16.py), else oneDNN with the weight reordered once into its blocked layout where that computes the plain
    matmul's numbers (bfloat16 on CPU): oneDNN then skips reading the plain layout on every call. The reordered
    copy is checked bit for bit against the plain matmul when made; if it differs, or the op is missing, the plain
    one is used. `parts`: the weights of the projections fused into `weight` (views of it), which oneDNN computes
    apart for more than FUSED_MAX_ROWS rows, or for any rows where the fused matmul was probed to differ from them."""

    def __init__(self, weight: torch.Tensor, kernels: Bf16Kernels | None = None, parts: tuple[torch.Tensor, ...] = ()):
        self.weight = weight
        self.kernels = kernels if kernels is not None and kernels.supports(weight) else None
        self.parts, self.fused_max_rows = (), FUSED_MAX_ROWS
        if self.kernels is not None:
            self.packed = self.kernels.pack(weight)
            return
        self.packed = _packed(weight) if _can_pack(weight) else None
        if len(parts) > 1:
            self.parts = parts
            self.fused_max_rows = FUSED_MAX_ROWS if _fusing_keeps_numbers(self) else 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.linear(x, self.packed)
        if self.parts and x.reshape(-1, x.shape[-1]).shape[0] > self.fused_max_rows:
            return self._apart(x)
        return self._fused(x)

    def _apart(self, x: torch.Tensor) -> torch.Tensor:
        """Each part's matmul alone, as the model's forward computes them."""
        return torch.cat([torch.nn.functional.linear(x, part) for part in self.parts], dim=-1)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return torch.nn.functional.linear(x, self.weight)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")


@dataclass(frozen=True)
class KernelNorm:
    """transformers' LlamaRMSNorm on lockstep's kernels."""
    kernels: Bf16Kernels
    weight: torch.Tensor
    eps: float

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.rms_norm(x, self.weight, self.eps)


@dataclass(frozen=True)
class _Layer:
    input_norm: Callable[[torch.Tensor], torch.Tensor]  # the model's RMSNorm, or a KernelNorm (`_norm`)
    qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, hidden]
    out: Linear  # [hidden, heads * head_dim]
    post_norm: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Linear  # [2 * intermediate, hidden]
    down: Linear  # [hidden, intermediate]


class FastDecoder:
    """`decode` runs one step of the decoding rows over the slot cache, `prefill` one chunk of one prompt."""

    def __init__(self, model: nn.Module, kernels: Bf16Kernels | None = None, share_matmuls_rows: int = 0,
                 whole_step_in_c: bool = True, q4: tuple[Q4Kernels, Q4Weights] | None = None):
        if q4 is not None:
            self._init_q4(model, *q4)
            return
        self.q4 = self.q4_stack = None
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.head_dim ** -0.5
        decoder = model.model
        self.embed = decoder.embed_tokens.weight
        self.rotary = decoder.rotary_emb
        self.final_norm = _norm(decoder.norm, kernels)
        self.lm_head = Linear(model.lm_head.weight, kernels)
        self.layers = [_fuse_layer(layer, kernels) for layer in decoder.layers]
        self.kernels = kernels if self.lm_head.kernels is not None else None  # None: oneDNN computes every matmul
        self.attention_on_kernels = self.kernels is not None and self.kernels.supports_attention(
            self.num_heads, self.num_kv_heads, self.head_dim)
        # Every reduction over a row on lockstep's kernels (the rest is elementwise): a row's numbers are the same
        # whatever else the step holds, even alone (oneDNN rounds a one-row matmul differently).
        linears = [self.lm_head, *(linear for layer in self.layers
                                   for linear in (layer.qkv, layer.out, layer.gate_up, layer.down))]
        norms = [self.final_norm, *(norm for layer in self.layers for norm in (layer.input_norm, layer.post_norm))]
        self.rows_independent = (self.attention_on_kernels and all(linear.kernels for linear in linears)
                                 and all(isinstance(norm, KernelNorm) for norm in norms))
        # Where every part is on the kernels, a decode step is one C call (`whole_step_in_c`): every layer, the
        # final norm and the lm_head, the same numbers as `_layer` on the kernels bit for bit, without its ~20
        # torch calls per layer; steps of at most `share_matmuls_rows` rows share their matmuls with the kernels'
        # helper thread.
        self.stack = _decoder_stack(self.layers, self.final_norm, self.lm_head, self.num_heads, self.num_kv_heads,
                                    self.head_dim) if self.rows_independent and whole_step_in_c else None
        self.share_matmuls_rows = share_matmuls_rows
        # Prompt chunks call transformers' SDPA attention with the model's own attention modules (as its forward).
        self.attention_modules = [layer.self_attn for layer in decoder.layers]

    def _init_q4(self, model: nn.Module, kernels: Q4Kernels, weights: Q4Weights) -> None:
        """On the model's own 4-bit blocks (q4.py): decode steps and prompt chunks each in one C call, computed
        alike (a prompt's cache is one slot), every row the same whatever else the call holds."""
        config, decoder = model.config, model.model
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.token_rows, self.rotary = weights.token_rows, decoder.rotary_emb
        # Gemma scales the embedded tokens (by sqrt(hidden), in float32 as its float32 embedding module does)
        scale = getattr(decoder.embed_tokens, "embed_scale", None)
        self.embed_scale = None if scale is None else scale.to(torch.float32)
        is_gemma = config.model_type == "gemma3_text"
        kinds = set(getattr(config, "layer_types", None) or ()) if is_gemma else set()  # the module's tables
        self.rotary_table = RotaryTable(self.rotary, min(kinds) if kinds else None)  # "full_attention" first
        self.local_rotary_table = RotaryTable(self.rotary, "sliding_attention") if "sliding_attention" in kinds \
            else None
        self.kernels, self.stack, self.share_matmuls_rows, self.layers = None, None, 0, []
        self.attention_on_kernels, self.rows_independent = False, True
        self.q4 = kernels
        layers = decoder.layers
        shift = 1.0 if is_gemma else 0.0  # Gemma's norms multiply by 1 + w, computed in float32 as it does

        def multiplier(norm: nn.Module) -> torch.Tensor:
            return norm.weight.float() + shift if shift else norm.weight

        pre_ffn = [layer.pre_feedforward_layernorm if is_gemma else layer.post_attention_layernorm
                   for layer in layers]
        epsilons = [_epsilon(norm) for layer, ffn in zip(layers, pre_ffn) for norm in (layer.input_layernorm, ffn)]
        output_norms = [(multiplier(layer.post_attention_layernorm), multiplier(layer.post_feedforward_layernorm))
                        for layer in layers] if is_gemma else None
        self.q4_stack = Q4Stack(weights, [multiplier(layer.input_layernorm) for layer in layers],
                                [multiplier(norm) for norm in pre_ffn], epsilons + [_epsilon(decoder.norm)],
                                multiplier(decoder.norm), config, kernels, output_norms)

    def new_prompt_cache(self, num_tokens: int) -> PromptCache | DynamicCache:
        """A prompt's own cache for `prefill`: one slot of the 4-bit path's layout (`num_tokens` positions: the
        prompt and its answer, as the row it becomes decodes in it), or transformers' cache."""
        if self.q4 is None:
            return DynamicCache()
        return PromptCache(self.q4_stack.num_layers, self.num_kv_heads, num_tokens, self.head_dim, self.q4.kv_dtype)

    def _q4_rows(self, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, caches: SlotTables,
                 logit_rows: torch.Tensor) -> torch.Tensor:
        hidden = self.token_rows(token_ids)  # [N, hidden]
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        cos, sin = self.rotary_table(positions)  # [N, head_dim] each
        local = self.local_rotary_table(positions) if self.local_rotary_table is not None else None
        return self.q4.forward(self.q4_stack, hidden, slots, positions, cos, sin, caches, logit_rows, local)

    @property
    def reads_decode_mask(self) -> bool:
        """Whether `decode` reads the attention mask (the C steps attend to positions 0..p of each row alone)."""
        return self.q4 is None and self.stack is None

    @staticmethod
    def supports(model: nn.Module, any_dtype: bool = False, on_4_bit_kernels: bool = False) -> bool:
        """Whether this forward computes `model` (on the 4-bit kernels: Qwen2's biases and Qwen3's q/k norms too)."""
        config = model.config
        decoder = getattr(model, "model", None)
        model_types = Q4_MODEL_TYPES if on_4_bit_kernels else SUPPORTED_MODEL_TYPES
        activations = ACTIVATIONS if on_4_bit_kernels else {"silu"}
        return (config.model_type in model_types and activation_of(config) in activations
                and getattr(config, "attn_logit_softcapping", None) is None
                and getattr(config, "final_logit_softcapping", None) is None
                and not getattr(config, "attention_bias", False) and not getattr(config, "mlp_bias", False)
                and getattr(decoder, "rotary_emb", None) is not None and hasattr(model, "lm_head")
                and model.lm_head.bias is None and (any_dtype or _can_pack(model.lm_head.weight)))

    def decode(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor,
               cache: SlotKVCache | RowKVCache) -> torch.Tensor:
        """One token per row: input_ids and position_ids [B, 1], attention_mask [B, 1, 1, capacity] from
        `cache.prepare_decode`. Returns the logits [B, V]. The 4-bit path reads either cache (RowKVCache: its
        own), the others a SlotKVCache."""
        if self.q4 is not None:
            return self._q4_rows(input_ids[:, 0], position_ids[:, 0].contiguous(), cache.step_slots,
                                 cache.slot_tables(), torch.arange(len(input_ids)))
        hidden = self.embed[input_ids[:, 0]]  # [B, hidden]
        cos, sin = self.rotary(hidden, position_ids)  # [B, 1, head_dim], the model's dtype
        if self.stack is not None:
            return self.kernels.decode_step(self.stack, hidden, position_ids[:, 0], cos[:, 0], sin[:, 0], cache.keys,
                                            cache.values, share_matmuls=len(hidden) <= self.share_matmuls_rows)
        lengths = position_ids[:, 0] + 1 if self.attention_on_kernels else None  # the kernels' mask: positions 0..p
        for index, layer in enumerate(self.layers):
            hidden = self._layer(hidden, layer, cos, sin, attention_mask, lengths, cache, index)
        hidden = self.final_norm(hidden)
        return self.lm_head(hidden)

    def prefill(self, token_ids: torch.Tensor, start: int, cache: DynamicCache,
                all_positions: bool = False) -> torch.Tensor:
        """One chunk of one prompt, tokens `start`.. of it ([C] ids), into its own cache. Returns the last
        position's logits [V], or with `all_positions` every position's [C, V]."""
        if self.q4 is not None:
            positions = torch.arange(start, start + len(token_ids))
            logit_rows = torch.arange(0 if all_positions else len(token_ids) - 1, len(token_ids))
            logits = self._q4_rows(token_ids, positions, torch.zeros(len(token_ids), dtype=torch.int64),
                                   SlotTables([(cache.keys, cache.values)]), logit_rows)
            return logits if all_positions else logits[0]
        hidden = self.embed[token_ids]  # [C, hidden]
        positions = torch.arange(start, start + len(token_ids), device=token_ids.device)
        cos, sin = self.rotary(hidden, positions[None])  # [1, C, head_dim]
        cos, sin = cos[0, :, None], sin[0, :, None]  # [C, 1, head_dim]: broadcast over heads
        # The model's own mask: none from the start of a prompt (SDPA's causal kernel), else each chunk token
        # sees the cached prompt and the chunk up to itself.
        visible = None if start == 0 else \
            (torch.arange(start + len(token_ids), device=token_ids.device) <= positions[:, None])[None, None]
        for index, (layer, attention_module) in enumerate(zip(self.layers, self.attention_modules)):
            hidden = self._prefill_layer(hidden, layer, attention_module, cos, sin, visible, cache, index)
        if not all_positions:
            hidden = hidden[-1:]
        logits = self.lm_head(self.final_norm(hidden))
        return logits if all_positions else logits[0]

    @property
    def prefills_together(self) -> bool:
        """Whether `prefill_many` feeds several prompts in one pass over the weights (the 4-bit path)."""
        return self.q4 is not None

    def prefill_many(self, chunks: list[tuple[torch.Tensor, int, PromptCache]]) -> torch.Tensor:
        """Chunks of several prompts, each (ids [C], start, its own cache) as `prefill` takes them, in one pass
        over the weights: every row is computed as it is alone (the kernels' rows do not depend on the batch), so
        each prompt's last logits are `prefill`'s bits. Returns them [len(chunks), V]."""
        token_ids = torch.cat([ids for ids, _, _ in chunks])
        positions = torch.cat([torch.arange(start, start + len(ids)) for ids, start, _ in chunks])
        slots = torch.cat([torch.full((len(ids),), i, dtype=torch.int64) for i, (ids, _, _) in enumerate(chunks)])
        logit_rows = torch.cumsum(torch.tensor([len(ids) for ids, _, _ in chunks]), 0) - 1
        tables = SlotTables([(cache.keys, cache.values) for _, _, cache in chunks])
        return self._q4_rows(token_ids, positions, slots, tables, logit_rows)

    def _prefill_layer(self, hidden, layer: _Layer, attention_module, cos, sin, visible, cache, index: int):
        length = hidden.shape[0]
        query, key, value = self._project(hidden, layer, cos, sin)
        keys, values = cache.update(key.transpose(0, 1)[None], value.transpose(0, 1)[None], index)  # [1, kv, C, D]
        if length == 1:  # one query token: the decode attention, as the model's forward (kv_cache.slot_attention)
            lengths = torch.tensor([keys.shape[2]]) if self.attention_on_kernels else None
            attended = self._attention(query, keys, values, None, lengths)
        else:
            attended, _ = sdpa_attention_forward(attention_module, query.transpose(0, 1)[None], keys, values, visible,
                                                 scaling=self.scaling)
        return self._feed_forward(hidden, attended.reshape(length, self.num_heads * self.head_dim), layer)

    def _layer(self, hidden, layer: _Layer, cos, sin, attention_mask, lengths, cache: SlotKVCache, index: int):
        query, key, value = self._project(hidden, layer, cos, sin)
        keys, values = cache.update(key.unsqueeze(2), value.unsqueeze(2), index)
        return self._feed_forward(hidden, self._attention(query, keys, values, attention_mask, lengths), layer)

    def _project(self, hidden, layer: _Layer, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [N, heads, head_dim], keys and values [N, kv_heads, head_dim] of N tokens, rotated (cos/sin:
        [N, 1, head_dim])."""
        normed = layer.input_norm(hidden)
        heads = layer.qkv(normed).view(hidden.shape[0], self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        rotated = _rotate(heads[:, :self.num_heads + self.num_kv_heads], cos, sin)  # queries and keys at once
        return rotated[:, :self.num_heads], rotated[:, self.num_heads:], heads[:, self.num_heads + self.num_kv_heads:]

    def _feed_forward(self, hidden, attended, layer: _Layer) -> torch.Tensor:
        """The rest of the layer after attention: output projection, residual, norm, SwiGLU MLP, residual."""
        hidden = hidden + layer.out(attended)
        gate_up = layer.gate_up(layer.post_norm(hidden))
        if self.kernels is not None and self.rows_independent:  # the fused decode's SwiGLU: chunks compute as steps
            activated = self.kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            activated = torch.nn.functional.silu(gate) * up
        return hidden + layer.down(activated)

    def _attention(self, query, keys, values, attention_mask, lengths) -> torch.Tensor:
        """One query token per row ([B, heads, head_dim]) over its slot: on lockstep's kernels where they run
        (lengths [B]: how many positions each row attends to), else as the model's forward computes it."""
        if lengths is not None:
            attended = self.kernels.decode_attention(query.contiguous(), keys, values, lengths, self.scaling)
        else:
            attended = one_query_attention(query, keys, values, attention_mask, self.scaling)
        return attended.view(query.shape[0], self.num_heads * self.head_dim)


class RotaryTable:
    """The model's rotary cos and sin of every position up to the longest seen, computed once (each entry is the
    module's inv_freq * position, then its cos or sin, rounded to float32: the same numbers however many positions
    one call takes, and in every process), then looked up per step instead of ~10 torch calls each time."""

    def __init__(self, rotary: nn.Module, layer_type: str | None = None):
        """`layer_type`: which of the module's frequencies (Gemma 3 has one set for full and one for sliding-window
        layers); None: its only ones."""
        self.rotary, self.layer_type = rotary, layer_type
        self.cos = self.sin = torch.empty((0, 0))
        # Other rope types (dynamic scaling) change the frequencies with the length: those ask the module each time.
        rope_type = getattr(rotary, "rope_type", "default")
        self.static = (rope_type[layer_type] if layer_type else rope_type) == "default"
        prefix = f"{layer_type}_" if layer_type else ""
        self.inv_freq = getattr(rotary, f"{prefix}inv_freq")
        self.attention_scaling = float(getattr(rotary, f"{prefix}attention_scaling", 1.0))

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, head_dim] (float32, contiguous) of positions [N] (int64)."""
        if not self.static:
            kind = {"layer_type": self.layer_type} if self.layer_type else {}
            cos, sin = self.rotary(torch.empty((1, len(positions), 1)), positions[None], **kind)
            return cos[0].float().contiguous(), sin[0].float().contiguous()
        if positions.numel() and int(positions.max()) >= len(self.cos):
            self._grow(int(positions.max()) + 1)
        return self.cos[positions], self.sin[positions]

    def _grow(self, num_positions: int) -> None:
        """Angles inv_freq * position in float32, as the module's, then their cos and sin in float64 rounded to
        float32 (within a unit in the last place of the module's float32 ones). The module's own cos of the same
        angles came out different in about one process of ten (half the table's entries off in the last bits;
        more often when computed in pieces), so a restart could change the 4-bit path's greedy answers."""
        size = max(2 * len(self.cos), 1024, num_positions)
        inv_freq = self.inv_freq.detach().float().cpu().numpy()
        angles = np.arange(size, dtype=np.float32)[:, None] * inv_freq[None, :]  # float32 products, as torch's
        angles = np.concatenate([angles, angles], axis=1).astype(np.float64)
        scaling = self.attention_scaling
        self.cos = torch.from_numpy(np.cos(angles).astype(np.float32) * np.float32(scaling)).contiguous()
        self.sin = torch.from_numpy(np.sin(angles).astype(np.float32) * np.float32(scaling)).contiguous()


def _epsilon(norm: nn.Module) -> float:
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def _fuse_layer(layer: nn.Module, kernels: Bf16Kernels | None) -> _Layer:
    attention, mlp = layer.self_attn, layer.mlp
    qkv_projections = (attention.q_proj, attention.k_proj, attention.v_proj)
    gate_up_projections = (mlp.gate_proj, mlp.up_proj)
    qkv, gate_up = _fuse(*qkv_projections), _fuse(*gate_up_projections)  # the projections' weights: views of them
    return _Layer(_norm(layer.input_layernorm, kernels),
                  Linear(qkv, kernels, tuple(projection.weight for projection in qkv_projections)),
                  Linear(attention.o_proj.weight, kernels), _norm(layer.post_attention_layernorm, kernels),
                  Linear(gate_up, kernels, tuple(projection.weight for projection in gate_up_projections)),
                  Linear(mlp.down_proj.weight, kernels))


def _norm(module: nn.Module, kernels: Bf16Kernels | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The RMSNorm on lockstep's kernels where they can read the module (LlamaRMSNorm's weight and epsilon), else
    the module's own forward (without module hooks)."""
    weight, eps = getattr(module, "weight", None), getattr(module, "variance_epsilon", None)
    if kernels is None or not isinstance(weight, torch.Tensor) or weight.dtype != torch.bfloat16 \
            or not isinstance(eps, float):
        return module.forward
    return KernelNorm(kernels, weight.detach().contiguous(), eps)


def _decoder_stack(layers: list[_Layer], final_norm: KernelNorm, lm_head: Linear, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> DecoderStack | None:
    weights = [LayerWeights(layer.input_norm.weight, layer.input_norm.eps, layer.qkv.packed, layer.out.packed,
                            layer.post_norm.weight, layer.post_norm.eps, layer.gate_up.packed, layer.down.packed)
               for layer in layers]
    try:
        return DecoderStack(final_norm.kernels, weights, final_norm.weight, final_norm.eps, lm_head.packed, num_heads,
                            num_kv_heads, head_dim)
    except ValueError as exc:
        logger.info("decode steps layer by layer: %s", exc)
        return None


def _can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


@torch.no_grad()  # with autograd on, oneDNN computes one row differently (measured)
def _packed(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's reordered copy of `weight`, if it gives the plain matmul's numbers bit for bit (probed at 1, 2, 3
    and 33 rows: the plain matmul itself rounds one row differently from several, and so must this)."""
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)
        probe = torch.randn(PROBE_ROWS, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
        same = all(torch.equal(torch.ops.mkldnn._linear_pointwise(probe[:rows], packed, None, "none", [], ""),
                               torch.nn.functional.linear(probe[:rows], weight)) for rows in (1, 2, 3, PROBE_ROWS))
    except RuntimeError as exc:
        logger.warning("oneDNN's reordered matmul is unavailable (%s); plain matmuls", exc)
        return None
    if not same:
        logger.warning("oneDNN's reordered matmul differs from the plain one for a %s weight; plain matmuls",
                       tuple(weight.shape))
        return None
    return packed


@lru_cache(maxsize=None)
def _fusion_probe(in_features: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(FUSED_MAX_ROWS, in_features, generator=torch.Generator().manual_seed(0)).to(device, dtype)


@torch.no_grad()
def _fusing_keeps_numbers(linear: Linear) -> bool:
    """Whether the fused matmul gives its parts' numbers, each computed alone as the model's forward does, at 1, 2,
    3, 33 and FUSED_MAX_ROWS rows."""
    probe = _fusion_probe(linear.weight.shape[1], linear.weight.dtype, linear.weight.device)
    for rows in (1, 2, 3, PROBE_ROWS, FUSED_MAX_ROWS):
        if not torch.equal(linear._fused(probe[:rows]), linear._apart(probe[:rows])):
            logger.info("a fused %s weight differs from its parts on oneDNN; its parts are computed apart",
                        tuple(linear.weight.shape))
            return False
    return True


def _fuse(*projections: nn.Linear) -> torch.Tensor:
    """One weight for several projections of the same input; each projection's weight becomes a (contiguous)
    row slice of it, so the model's forward reads the same storage."""
    fused = torch.cat([projection.weight.detach() for projection in projections], dim=0)
    start = 0
    for projection in projections:
        rows = projection.weight.shape[0]
        projection.weight = nn.Parameter(fused[start:start + rows], requires_grad=False)
        start += rows
    return fused


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary_pos_emb for [B, heads, head_dim] with cos/sin [B, 1, head_dim]."""
    half = states.shape[-1] // 2
    rotated = torch.cat((-states[..., half:], states[..., :half]), dim=-1)
    return states * cos + rotated * sin

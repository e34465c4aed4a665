"""Hugging Face transformers backend: a KV-cached batch that requests join and leave.

Decoding rows live in a preallocated slot cache (kv_cache.py), each with its own position ids, so nothing is
re-padded per step and a short prompt batched with a long one computes what it would alone. A step frees finished
rows, feeds prompt chunks within a budget (fewest tokens left first; chunks shrink as the context grows, so a long
prompt costs the running streams a bounded gap per step, not one long stall), decodes one token for every row
(skipped once when a prompt just produced its first token, so it goes out at once), and then lets the finished
prompts join. Llama-shaped models run through fast_forward.py (lockstep's bf16 kernels or oneDNN), a GGUF file of
every family it reads on its own blocks with the 4-bit kernels (`_q4_mode`); other models through their own
forward.

Batch invariance (`batch_invariant`, on by default): a request's greedy tokens are the ones it gets alone. Its
chunks are planned from its own prompt only, each decode row's attention reads only its own slot, and oneDNN's
matmuls never decode a lone row (they round one row differently from two or more), so one row is padded to two.

A failure that belongs to one request (its sampler, its prefill) drops that request and is reported in the
StepOutput; only a failure of the shared decode forward fails the step.
"""
import inspect
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import DynamicCache

from ..config import EngineConfig
from ..errors import describe
from ..hardware import choose_dtype, detect_host, memory_headroom, torch_threads
from ..memory import release_freed_memory
from ..messages import ModelInfo, NewRequest, PromptLogprobs, StepOutput, WorkerSampling, eos_ids
from .. import gguf_export
from ..model_store import gguf_of, source_record
from .base import Backend, resolve_device
from .bf16 import Bf16Kernels, load_bf16_kernels
from .constrained import GrammarCompiler
from .fast_forward import FastDecoder
from .kv_cache import RowKVCache, SlotKVCache, kv_budget_within, use_slot_attention
from .prefix_cache import PrefixCache, restore
from .gguf_weights import empty_model, load_model
from .q4 import Q4Kernels, Q4Weights, format_name, load_q4_kernels
from .sampler import TokenSampler, add_prompt_logprobs, samplers_for

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DEFAULT_CONTEXT = 2048
# What can go wrong for one request without saying anything about the others (a bad value, a bad shape).
REQUEST_ERRORS = (RuntimeError, ValueError, IndexError, TypeError, OverflowError, ZeroDivisionError)
ATTENTION_COST_SCALE = 500  # context length at which a prompt token costs twice one at context 0 (measured, CPU)
MIN_CHUNK_TOKENS = 16
ECHO_CHUNK_TOKENS = 64  # see `_chunk_size`: 64 positions' logits ~13 MB for a 49,152-token vocabulary
TRIM_AFTER_COLUMNS = 1024  # hand memory back to the OS when a free shortens the batch by this many positions
INVARIANT_MIN_ROWS = 2  # batch invariance: oneDNN's matmuls never run at one row (see the docstring)
# Batch invariance: a prompt chunk's cost (see `_cost_units`) whatever its context, so a stream beside a long prompt
# waits about one such chunk per step: the bound on its gap.
INVARIANT_CHUNK_UNITS = 256
FIRST_CHUNK_TOKENS = 64  # before any chunk was timed
# A lone prompt's step, no stream beside it: a request that arrives meanwhile waits for the step in progress (a
# 512-token chunk deep into a long prompt takes seconds on 2 cores: docs/benchmarks.md), while shorter chunks cost it
# little each.
ALONE_STEP_TARGET_S = 1.0
PROMPT_LOGPROBS_CHUNK_TOKENS = 256  # echo keeps every position's logits: [chunk, V] float32 (~50 MB at 256)


@dataclass
class Row:
    request_id: str
    sampler: TokenSampler
    num_tokens: int  # tokens in the cache = position id of the next input token
    last_token_id: int
    token_ids: list[int]  # the prompt and every token sampled since (the last one not yet in the cache)
    cache_salt: str | None = None


@dataclass
class Prefill:
    """A new request whose prompt is being fed, chunk by chunk, into a cache of its own. Its samples (one, or
    n / best_of) fork from that cache when the prompt is done."""

    request: NewRequest
    samplers: dict[str, TokenSampler]  # sample id -> its sampler
    cache: DynamicCache
    num_computed: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # echo: gathered chunk by chunk

    @property
    def num_left(self) -> int:
        return len(self.request.prompt_token_ids) - self.num_computed


class HFBackend(Backend):
    def __init__(self, config: EngineConfig, model_path: str):
        host = detect_host()
        threads, why_fewer = torch_threads(config.num_threads, host)
        if why_fewer:
            logger.info("torch threads: %d of %d, on %s", threads, config.num_threads, why_fewer)
        torch.set_num_threads(threads)
        self.device = torch.device(resolve_device(config.device))
        gguf = gguf_of(model_path, config) if self.device.type == "cpu" else None
        layout_problem = Q4Weights.layout_problem(gguf) if gguf is not None else ""
        if layout_problem:  # a GGUF of other blocks: its weights dequantized, as for a Hugging Face folder
            gguf = None
        q4_mode, why_not = _q4_mode(config, gguf)
        why_not = layout_problem or why_not
        dtype, self.compute_reason = ("float32", "the model's own 4-bit blocks") if q4_mode else \
            choose_dtype(config.dtype, self.device.type, host)
        if why_not:
            self.compute_reason += f" ({why_not})"
        if q4_mode and gguf is not None:  # every parameter comes from the GGUF: the safetensors are not read
            self.model = empty_model(model_path)
        else:
            self.model = load_model(model_path, DTYPES[dtype])
        self.model.to(self.device).eval()
        q4 = self._q4(config, gguf, host, exact=q4_mode == "exact") if q4_mode else None
        self.compute_reason = _quantize_note(config, model_path, q4 is not None) + self.compute_reason
        self.accepts_logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.prefill_chunk_tokens = config.prefill_chunk_tokens
        self.prefill_step_target_s = config.prefill_step_target_s
        self.seconds_per_cost_unit: float | None = None  # measured: see `_chunk_size`
        self.batch_invariant = config.batch_invariant
        self.slot_attention = use_slot_attention(self.model)
        # A lean decode step over the slot cache (fast_forward.py); None: the model's forward decodes.
        use_fast = config.fast_decode and self.slot_attention and FastDecoder.supports(
            self.model, any_dtype=q4 is not None, on_4_bit_kernels=q4 is not None)
        if q4 is not None:
            q4[1].give_model_the_same_weights(self.model, projections=not use_fast)
        kernels = self._bf16_kernels(config) if use_fast and q4 is None else None
        self.fast_decoder = FastDecoder(self.model, kernels, config.kernel_helper_rows,
                                        q4=q4 if use_fast else None) if use_fast else None
        if q4 is not None and not use_fast:
            self.compute_reason += "; without the fast forward, the model's own on the same weights in float32"
        # the blocks mapped from the cache: resident as page cache, which MemAvailable counts as free
        self.mapped_weight_bytes = q4[1].mapped_bytes if q4 is not None else 0
        del q4  # the GGUF's blocks as read (the kernels keep their own layout): freed before memory is measured
        self.rows: list[Row] = []  # row i decodes in slot i of `cache`
        # made when the first row joins: each row its own on the 4-bit path, else one padded tensor per layer
        self.cache: RowKVCache | SlotKVCache | None = None
        self.prefills: deque[Prefill] = deque()
        self.joining: list[tuple[Prefill, list[Row]]] = []  # prompts done this step; their rows join after decode
        self.skipped_decode = False  # the last step returned first tokens without decoding the rows
        self.prefix_cache = self._prefix_cache(config)
        self.kv_budget_tokens = config.max_batch_kv_tokens  # positions of keys and values: rows, prompts and cache
        self.info = ModelInfo(
            model=model_path, backend="hf", dtype=str(self.model.dtype).removeprefix("torch."),
            device=str(self.device), max_model_len=_context_length(self.model.config, config.max_model_len),
            eos_token_ids=_eos_token_ids(self.model), compute=self._forward_name(),
            weights=self._kernel_formats(),
            compute_reason=f"{host.describe()}: {self.compute_reason}", prefix_cache=self.prefix_cache is not None,
            kv_per_row=self.kv_per_row, **_family_of(model_path, self.model.config))
        self.grammars = GrammarCompiler(model_path, getattr(self.model.config, "vocab_size", None),
                                        self.info.eos_token_ids)  # JSON mode; loads on first use
        logger.info("transformers backend: %s on %s, %d threads, prefill chunks of %d tokens, %s attention, "
                    "%s, batch invariance %s", self.info.dtype, self.device, torch.get_num_threads(),
                    self.prefill_chunk_tokens, "slot" if self.slot_attention else "the model's own",
                    self._forward_name(), "on" if self.batch_invariant else "off")
        logger.info("compute chosen for %s", self.info.compute_reason)
        self._warm_up()
        self._fit_kv_budget(config)

    @property
    def chunks_compute_alike(self) -> bool:
        """Whether a prompt's numbers do not depend on how it is chunked (the 4-bit path computes a chunk as decode
        steps): then chunks may follow the clock, and a prompt may resume from cached blocks."""
        return self.fast_decoder is not None and self.fast_decoder.q4 is not None

    @property
    def kv_per_row(self) -> bool:
        """Whether each row decodes in its prompt's own cache (RowKVCache): the 4-bit kernels find rows by address."""
        return self.chunks_compute_alike

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """A short prompt and a decode step before the worker says it is ready: the kernels' helper threads, their
        scratch memory and the allocator's pools then exist, so the first request is as fast as the next."""
        if self.fast_decoder is None:
            return
        request = NewRequest("warm-up", tuple(range(1, 9)), WorkerSampling(max_tokens=2))
        for new, finished in (((request,), ()), ((), ()), ((), ("warm-up",))):
            self.step(new, finished)
        self.seconds_per_cost_unit, self.skipped_decode = None, False  # an 8-token chunk says nothing of a real one
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
            self.prefix_cache.queried_tokens = self.prefix_cache.hit_tokens = 0

    def _fit_kv_budget(self, config: EngineConfig) -> None:
        """Keys and values within what memory leaves once the model is loaded and warm (a container's limit, a small
        machine; an equal share for each of `model_copies` workers): past it the kernel kills the model worker
        mid-batch, failing every running request (measured: 16 prompts of 3,500 tokens in a 1 GiB limit). A request
        longer than the context that fits, or whose samples together pass the budget, is refused up front."""
        if self.device.type != "cpu":
            return
        release_freed_memory()
        headroom = memory_headroom(mapped=self.mapped_weight_bytes)
        budget = kv_budget_within(None if headroom is None else headroom // config.model_copies,
                                  self._kv_bytes_per_position(), config.max_batch_kv_tokens, self.info.max_model_len,
                                  self._min_decode_rows())
        if budget.reason:
            logger.warning("KV budget: %s", budget.reason)
        self.kv_budget_tokens = budget.positions
        if isinstance(self.cache, SlotKVCache):  # the warm-up's
            self.cache.max_positions = budget.positions
        self.info = replace(self.info, max_model_len=budget.context, kv_budget_tokens=budget.positions,
                            kv_budget_reason=budget.reason)

    def _min_decode_rows(self) -> int:
        """Batch invariance on oneDNN's matmuls: decode never at one row (a padding row, which takes a slot)."""
        rows_independent = self.fast_decoder is not None and self.fast_decoder.rows_independent
        return INVARIANT_MIN_ROWS if self.batch_invariant and not rows_independent else 1

    def _kv_bytes_per_position(self) -> int:
        """Keys and values of one position in every layer, in the dtype the cache keeps them in."""
        config = self.model.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        q4 = self.fast_decoder.q4 if self.fast_decoder is not None else None
        dtype = q4.kv_dtype if q4 is not None else self.model.dtype
        return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize

    def _q4(self, config: EngineConfig, gguf: str | None, host,
            exact: bool) -> tuple[Q4Kernels, Q4Weights] | None:
        """The model's own 4-bit blocks and the kernels that read them (`exact`: on float32 activations), for the
        caller to give the model the same weights dequantized. None (the float32 model on the blocks' numbers, in the
        log why) where either is missing."""
        if gguf is None:
            self.compute_reason = f"weights={config.weights}, but this model has no 4-bit GGUF; float32"
            return None
        # every core during a step (helpers that sleep between steps); LOCKSTEP_KERNEL_HELPER_ROWS=0: one thread
        helpers = max(0, host.num_cores - 1) if config.kernel_helper_rows else 0
        kernels = load_q4_kernels(config.cache_dir, helpers, exact)
        if kernels is None:  # ValueError: not a layout the kernels read
            Q4Weights.from_gguf(gguf, self.model.config).give_model_the_same_weights(self.model)
            self.compute_reason = "no 4-bit kernels here (see the log); the same weights in float32"
            return None
        # the blocks in the kernels' layout, repacked once into the cache and mapped from there
        weights = Q4Weights.from_gguf(gguf, self.model.config, kernels, config.cache_dir)
        self.compute_reason = {
            "auto": "auto: the model ships 4-bit weights (lockstep's 4-bit kernels read them as they are)",
            "q4": "configured: weights=q4",
            "exact": "configured: weights=exact (the 4-bit blocks' own numbers, float32 activations)"}[config.weights]
        return kernels, weights

    def _prefix_cache(self, config: EngineConfig) -> PrefixCache | None:
        """Only where a prompt resumed from cached keys and values computes what it would from scratch (elsewhere
        chunk boundaries change the rounding)."""
        if not config.prefix_cache or not self.chunks_compute_alike:
            logger.info("prefix cache off: %s", "configured" if not config.prefix_cache else
                        "exact only on the 4-bit path, where chunking does not change the numbers")
            return None
        logger.info("prefix cache: up to %d tokens", config.prefix_cache_tokens)
        return PrefixCache(config.prefix_cache_tokens)

    def _bf16_kernels(self, config: EngineConfig) -> Bf16Kernels | None:
        """lockstep's kernels where they apply: they run on one core, so only with one torch thread."""
        if not config.bf16_kernel or self.model.dtype != torch.bfloat16 or self.device.type != "cpu":
            return None
        if torch.get_num_threads() != 1:
            logger.info("bf16 kernels: %d torch threads, and they run on one; oneDNN's matmuls",
                        torch.get_num_threads())
            return None
        return load_bf16_kernels(config.cache_dir)

    def _kernel_formats(self) -> str:
        """The block formats the 4-bit kernels read the layers in ("q4_1", "q4_k+q8_0", ...), "" off that path."""
        if self.fast_decoder is None or self.fast_decoder.q4 is None:
            return ""
        return "+".join(sorted({format_name(f) for f in self.fast_decoder.q4_stack.layer_formats}))

    def _forward_name(self) -> str:
        if self.fast_decoder is None:
            return "the model's forward"
        decoder = self.fast_decoder
        if decoder.q4 is not None:
            formats = " and ".join(name.upper() for name in self._kernel_formats().split("+"))
            return f"4-bit kernels, the GGUF's blocks as {formats} on {decoder.q4.name}, a decode step in one call"
        if decoder.kernels is None:
            return "fast forward on oneDNN's matmuls"
        if decoder.stack is None:
            return "fast forward on lockstep's bf16 kernels, layer by layer"
        helper = f"shared with a helper thread up to {decoder.share_matmuls_rows} rows" \
            if decoder.share_matmuls_rows else "on one thread"
        return f"fast forward on lockstep's bf16 kernels, a decode step in one call, its matmuls {helper}"

    @torch.inference_mode()
    def step(self, new_requests: tuple[NewRequest, ...], finished_ids: tuple[str, ...]) -> StepOutput:
        output = StepOutput()
        self._free(set(finished_ids), keep_prefixes=True)
        for request in new_requests:
            self._queue_prefill(request, output)
        self._fit_prefix_cache()
        feeds_prompts, reallocations = bool(self.prefills), self._reallocations()
        # Prompts first, and a step whose prompts produced first tokens returns them without decoding the streams
        # (unless the step before skipped already, so streams never wait two steps): a short prompt's first token
        # waits for its own prefill only, not for a decode of every stream too (TTFT beside 8 streams), and the
        # streams lose one round-trip. New rows join after any decode, which therefore runs on the same rows,
        # shapes and slots as it would have without the prompt.
        first_token_ids = self._prefill_chunks(output)
        output.new_token_ids.update(first_token_ids)
        skip_decode = bool(first_token_ids) and not self.skipped_decode
        if self.rows and not skip_decode:
            output.new_token_ids.update(self._decode(output))
        self.skipped_decode = bool(self.rows) and skip_decode
        for prefill, rows in self.joining:
            self._join_batch(prefill, rows)
        self.joining.clear()
        self._fit_prefix_cache()
        if feeds_prompts or self._reallocations() != reallocations:
            release_freed_memory()  # a prompt's chunks, a regrown cache: freed blocks glibc would keep resident
        return output

    def _reallocations(self) -> int:
        return self.cache.reallocations if self.cache is not None else 0

    def _fit_prefix_cache(self) -> None:
        """The cached prefixes get what the running rows' slots and the prompts being fed leave of the KV budget
        (up to their own bound): a full batch squeezes the cache, never the other way round."""
        if self.prefix_cache is None:
            return
        used = self.cache.positions if self.cache is not None else 0
        used += sum(len(prefill.request.prompt_token_ids) for prefill in self.prefills)
        self.prefix_cache.fit(self.kv_budget_tokens - used)

    @torch.inference_mode()  # freeing live rows zeroes their slots: inference tensors
    def close(self) -> None:
        self._free({row.request_id for row in self.rows} | {i for p in self.prefills for i in p.samplers})
        if self.prefix_cache is not None:
            self.prefix_cache.clear()

    def _queue_prefill(self, request: NewRequest, output: StepOutput) -> None:
        try:
            samplers = dict(zip(request.all_sample_ids, samplers_for(request, self.device, grammars=self.grammars)))
        except REQUEST_ERRORS as exc:
            output.failed.update(dict.fromkeys(request.all_sample_ids, describe(exc)))
            return
        echo = PromptLogprobs() if request.sampling.prompt_logprobs is not None else None
        num_tokens = len(request.prompt_token_ids) + request.sampling.max_tokens  # the row decodes in it (4-bit path)
        cache = self.fast_decoder.new_prompt_cache(num_tokens) if self.fast_decoder is not None else DynamicCache()
        prefill = Prefill(request, samplers, cache, prompt_logprobs=echo)
        if self.prefix_cache is not None and echo is None:  # echo needs every prompt position's logits
            blocks = self.prefix_cache.lookup(request.prompt_token_ids, request.cache_salt)
            prefill.num_computed = restore(blocks, cache.all_keys, cache.all_values)
        output.cached_tokens.update(dict.fromkeys(request.all_sample_ids, prefill.num_computed))
        self.prefills.append(prefill)

    def _decode(self, output: StepOutput) -> dict[str, tuple[int]]:
        failed = output.failed
        min_rows = self._min_decode_rows()
        token_ids = [row.last_token_id for row in self.rows]
        token_ids += token_ids[:1] * (min_rows - len(token_ids))  # padding rows: outputs ignored
        input_ids = torch.tensor(token_ids, device=self.device).unsqueeze(1)  # [B, 1]
        with_mask = self.fast_decoder is None or self.fast_decoder.reads_decode_mask
        position_ids, attention_mask = self.cache.prepare_decode(min_rows, with_mask)  # [B, 1], [B, 1, 1, capacity]
        if self.fast_decoder is not None:
            logits = self.fast_decoder.decode(input_ids, position_ids, attention_mask, self.cache)  # [B, V]
        else:
            logits = self._forward(input_ids, attention_mask, position_ids, self.cache)
        self.cache.finish_decode()
        picked: dict[int, torch.Tensor] = {}  # row index -> its token, still on the device
        greedy = _greedy_tokens(self.rows, logits)
        for i, row in enumerate(self.rows):
            row.num_tokens += 1  # the token just fed is in the cache now
            if greedy is not None and row.sampler.is_plain_greedy:
                picked[i] = greedy[i]
            elif (token := self._sample(row.request_id, row.sampler, logits[i], failed)) is not None:
                picked[i] = token
        new_token_ids = {}
        for i, token_id in zip(picked, _to_host(list(picked.values()))):
            row = self.rows[i]
            row.last_token_id = token_id
            row.token_ids.append(token_id)
            new_token_ids[row.request_id] = (token_id,)
            if (entry := row.sampler.accept(token_id)) is not None:
                output.logprobs[row.request_id] = (entry,)
        self._free(set(failed))
        return new_token_ids

    def _prefill_chunks(self, output: StepOutput) -> dict[str, tuple[int]]:
        """Feed prompt chunks within this step's budget, fewest tokens left first; finished prompts join.
        Beside decoding rows the budget is also one of time, so the streams' next token is not held up. Prompts
        that end this step go in one pass over the weights where the decoder can (a burst of new requests: one
        pass instead of one each), the others chunk by chunk."""
        budget, first_token_ids, together = self.prefill_chunk_tokens, {}, []
        deadline, planned_s = float("inf"), 0.0  # planned_s: what the prompts fed together are expected to take
        self.prefills = deque(sorted(self.prefills, key=lambda p: p.num_left))
        while self.prefills and budget > 0:
            if deadline == float("inf"):  # from now on a stream, or a request arriving, waits for this step
                target_s = self.prefill_step_target_s if self.rows or len(self.prefills) > 1 else ALONE_STEP_TARGET_S
                deadline = time.perf_counter() + target_s
            seconds_left = deadline - time.perf_counter() - planned_s
            if seconds_left <= 0:
                break
            prefill = self.prefills[0]
            num_tokens = self._chunk_size(prefill, seconds_left, budget)
            if prefill.prompt_logprobs is not None:
                num_tokens = min(num_tokens, PROMPT_LOGPROBS_CHUNK_TOKENS)
            if budget < self.prefill_chunk_tokens and not self._fits(prefill, num_tokens, seconds_left):
                break  # a chunk ran already: the next would hold the streams past the target
            budget -= num_tokens
            if self._feeds_together(prefill, num_tokens):
                together.append(self.prefills.popleft())
                planned_s += (self.seconds_per_cost_unit or 0.0) * _cost_units(prefill.num_computed, num_tokens)
            elif self._feed(prefill, num_tokens, output, first_token_ids):
                self.prefills.popleft()
        if len(together) == 1:
            self._feed(together[0], together[0].num_left, output, first_token_ids)
        elif together:
            self._feed_together(together, output, first_token_ids)
        return first_token_ids

    def _feeds_together(self, prefill: Prefill, num_tokens: int) -> bool:
        """Whether this chunk can go beside other prompts' in one pass: the whole rest of a prompt, on a decoder
        whose rows do not depend on the batch (the 4-bit path); prompt logprobs keep every position's logits."""
        return (num_tokens == prefill.num_left and prefill.prompt_logprobs is None and self.fast_decoder is not None
                and self.fast_decoder.prefills_together)

    def _feed(self, prefill: Prefill, num_tokens: int, output: StepOutput, first_token_ids: dict) -> bool:
        """One chunk of a prompt; a prompt that is done has its samples join. Returns whether the prompt is over
        (done, or failed): then it leaves the line."""
        try:
            logits = self._prefill_chunk(prefill, num_tokens)
        except REQUEST_ERRORS as exc:
            logger.exception("prefill of %s failed", prefill.request.request_id)
            output.failed.update(dict.fromkeys(prefill.samplers, describe(exc)))
            return True
        if prefill.num_left:
            return False
        self._prompt_done(prefill, logits, output, first_token_ids)
        return True

    def _feed_together(self, prefills: list[Prefill], output: StepOutput, first_token_ids: dict) -> None:
        """The rest of each prompt in one pass. Should that fail, each is fed alone, so a failure stays with its
        request (the pass rewrites only the prompts' own positions)."""
        chunks = [(torch.tensor(p.request.prompt_token_ids[p.num_computed:], device=self.device), p.num_computed,
                   p.cache) for p in prefills]
        started = time.perf_counter()
        try:
            logits = self.fast_decoder.prefill_many(chunks)
        except (*REQUEST_ERRORS, MemoryError) as exc:  # MemoryError: the kernels' scratch for all the rows at once
            logger.warning("%d prompts fed together failed (%s): feeding them one at a time", len(prefills), exc)
            for prefill in prefills:
                self._feed(prefill, prefill.num_left, output, first_token_ids)
            return
        logger.debug("prefill of %d prompts together: %d tokens in %.3f s", len(prefills),
                     sum(len(ids) for ids, _, _ in chunks), time.perf_counter() - started)
        for prefill, row in zip(prefills, logits):
            prefill.num_computed = len(prefill.request.prompt_token_ids)
            self._prompt_done(prefill, row, output, first_token_ids)

    def _prompt_done(self, prefill: Prefill, logits: torch.Tensor, output: StepOutput, first_token_ids: dict) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.insert(prefill.request.prompt_token_ids, prefill.request.cache_salt,
                                     _prompt_views(prefill.cache))
        first_token_ids.update(self._first_tokens(prefill, logits, output))

    def _first_tokens(self, prefill: Prefill, logits: torch.Tensor, output: StepOutput) -> dict[str, tuple[int]]:
        """Each sample's first token from the prompt's last logits; the samples that go on join the batch,
        forking the one prompt cache (n > 1, best_of: one prefill for all)."""
        first_token_ids, rows = {}, []
        for sample_id, sampler in prefill.samplers.items():
            if (token := self._sample(sample_id, sampler, logits, output.failed)) is None:
                continue
            token_id = int(token)  # once per prompt, not per step
            first_token_ids[sample_id] = (token_id,)
            if (entry := sampler.accept(token_id)) is not None:
                output.logprobs[sample_id] = (entry,)
            if prefill.prompt_logprobs is not None:
                output.prompt_logprobs[sample_id] = prefill.prompt_logprobs
            rows.append(Row(sample_id, sampler, prefill.num_computed, token_id,
                            [*prefill.request.prompt_token_ids, token_id], prefill.request.cache_salt))
        if rows and prefill.request.sampling.max_tokens > 1:  # else they are done: no need to pad the batch to them
            self.joining.append((prefill, rows))
        return first_token_ids

    def _chunk_size(self, prefill: Prefill, seconds_left: float, budget: int) -> int:
        """As `_clocked_chunk_size`, and where chunking does not change the numbers, echo's chunks short: its prompt
        logprobs keep every position's logits and their log-softmax (a 512-token chunk ~200 MB for the embedded model:
        in a 768 MB limit, 16 echo requests got the model worker OOM-killed)."""
        size = self._clocked_chunk_size(prefill, seconds_left, budget)
        if prefill.prompt_logprobs is not None and self.chunks_compute_alike:
            return min(size, ECHO_CHUNK_TOKENS)
        return size

    def _clocked_chunk_size(self, prefill: Prefill, seconds_left: float, budget: int) -> int:
        """Batch-invariant where chunking changes the numbers: the prompt's own plan, whatever else runs (a step's
        budget and time decide how many chunks it feeds, never their sizes). Otherwise a chunk that fits in
        `seconds_left` (the step's target: beside decoding rows or other prompts short, alone ALONE_STEP_TARGET_S),
        judged by what earlier chunks cost per unit (see `_cost_units`); before any was timed, the budget's worth
        alone, a small one beside streams."""
        if self.batch_invariant and not self.chunks_compute_alike:
            return planned_chunk_size(prefill.num_computed, prefill.num_left, self.prefill_chunk_tokens,
                                      INVARIANT_CHUNK_UNITS)
        if self.seconds_per_cost_unit is None:
            return min(budget, prefill.num_left, FIRST_CHUNK_TOKENS if self.rows else budget)
        affordable = _tokens_within(seconds_left / self.seconds_per_cost_unit, prefill.num_computed)
        return min(budget, prefill.num_left, max(MIN_CHUNK_TOKENS, affordable))

    def _fits(self, prefill: Prefill, num_tokens: int, seconds_left: float) -> bool:
        """Whether a chunk is expected to end within `seconds_left`, from what earlier chunks cost per unit."""
        if self.seconds_per_cost_unit is None:
            return True
        return self.seconds_per_cost_unit * _cost_units(prefill.num_computed, num_tokens) <= seconds_left

    def _prefill_chunk(self, prefill: Prefill, num_tokens: int) -> torch.Tensor:
        start, end = prefill.num_computed, prefill.num_computed + num_tokens
        token_ids = torch.tensor(prefill.request.prompt_token_ids[start:end], device=self.device)  # [C]
        started = time.perf_counter()
        echo = prefill.prompt_logprobs is not None
        if self.fast_decoder is not None:
            logits = self.fast_decoder.prefill(token_ids, start, prefill.cache, all_positions=echo)[None]
        else:
            position_ids = torch.arange(start, end, device=self.device).unsqueeze(0)  # [1, C]
            attention_mask = torch.ones((1, end), dtype=torch.long, device=self.device)  # [1, cached + C]
            logits = self._forward(token_ids[None], attention_mask, position_ids, prefill.cache, all_positions=echo)
        elapsed = time.perf_counter() - started
        self._record_chunk_cost(elapsed, _cost_units(start, num_tokens))
        logger.debug("prefill %s: tokens %d-%d in %.3f s", prefill.request.request_id, start, end, elapsed)
        prefill.num_computed = end
        if echo:  # logits: [1, C, V]; position i predicts prompt token i + 1
            request = prefill.request
            next_token_ids = list(request.prompt_token_ids[start + 1:end + 1])
            add_prompt_logprobs(prefill.prompt_logprobs, logits[0], next_token_ids, request.sampling.prompt_logprobs)
            return logits[0, -1]
        return logits[0]

    def _record_chunk_cost(self, seconds: float, units: float) -> None:
        measured = seconds / units
        previous = self.seconds_per_cost_unit
        self.seconds_per_cost_unit = measured if previous is None else 0.7 * previous + 0.3 * measured

    def _join_batch(self, prefill: Prefill, rows: list[Row]) -> None:
        """Each row (a sample; n > 1 forks) gets a slot holding its copy of the one prefilled prompt; on the 4-bit
        path the first takes the prompt's cache itself (sized for its answer), the others a copy."""
        if self.kv_per_row:
            self.cache = self.cache if self.cache is not None else RowKVCache()
            for fork, row in enumerate(rows):
                self.cache.add_row(prefill.cache.copy(prefill.num_computed) if fork else prefill.cache,
                                   prefill.num_computed)
                self.rows.append(row)
            return
        layers = _kv(prefill.cache)
        if self.cache is None:
            _, num_kv_heads, _, head_dim = layers[0][0].shape
            self.cache = SlotKVCache(len(layers), num_kv_heads, head_dim, layers[0][0].dtype, self.device,
                                     self.kv_budget_tokens)
        for row in rows:
            self.cache.add_row(layers, prefill.num_computed)
            self.rows.append(row)

    def _forward(self, input_ids, attention_mask, position_ids, cache, all_positions: bool = False) -> torch.Tensor:
        """The last position's logits [B, V], or with `all_positions` every position's [B, S, V]."""
        extra = {"logits_to_keep": 0 if all_positions else 1} if self.accepts_logits_to_keep else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, **extra)
        return out.logits if all_positions else out.logits[:, -1, :]

    @staticmethod
    def _sample(request_id: str, sampler: TokenSampler, logits: torch.Tensor,
                failed: dict[str, str]) -> torch.Tensor | None:
        """The request's next token (0-d, on the device), or None (and an entry in `failed`) if its sampling
        raised."""
        try:
            return sampler(logits)
        except REQUEST_ERRORS as exc:
            logger.exception("sampling for %s failed", request_id)
            failed[request_id] = describe(exc)
            return None

    def _free(self, finished_ids: set[str], keep_prefixes: bool = False) -> None:
        """Drop the requests' state; `keep_prefixes`: their rows' keys and values go to the prefix cache (a
        finished answer is the start of the next turn's prompt)."""
        if not finished_ids:
            return
        for prefill in self.prefills:
            prefill.samplers = {i: s for i, s in prefill.samplers.items() if i not in finished_ids}
        self.prefills = deque(p for p in self.prefills if p.samplers)
        gone = {i for i, row in enumerate(self.rows) if row.request_id in finished_ids}
        if not gone:
            return
        if keep_prefixes and self.prefix_cache is not None:
            for i in sorted(gone):
                row = self.rows[i]
                self.prefix_cache.insert(row.token_ids[:row.num_tokens], row.cache_salt, self.cache.row_views(i))
        for source, target in self.cache.remove_rows(gone):  # the last rows moved into the freed slots
            self.rows[target] = self.rows[source]
        del self.rows[len(self.rows) - len(gone):]
        freed_positions = self.cache.shrink()
        # Without the trims glibc keeps the peak of every long prompt: the worker's memory would only grow.
        if not self.rows or freed_positions >= TRIM_AFTER_COLUMNS:
            release_freed_memory()


def _quantize_note(config: EngineConfig, model_path: str, on_blocks: bool) -> str:
    """What `quantize` did: the folder's weights quantized at load, or why it did not apply."""
    if config.quantize == "none" or source_record(Path(model_path)) is not None:
        return ""
    if gguf_export.architecture_of(model_path) is None:
        return f"quantize={config.quantize} does not apply (it quantizes {', '.join(gguf_export.FAMILIES)}); "
    if not on_blocks:
        return f"quantize={config.quantize} not used on {config.device}; "
    return f"quantize={config.quantize}: the folder's weights quantized once at load (engine/gguf_export.py); "


def _q4_mode(config: EngineConfig, gguf: str | None) -> tuple[str, str]:
    """How to compute on the model's 4-bit blocks ("q4": 8-bit activations, "exact": float32 ones, "": not on
    them), and why not where it is "". `exact` where the model ships them and the dtype is float32 or auto (the
    blocks' own numbers: the same as the float32 dequantized model but for the order of sums); `auto`: q4 where
    the model ships them, unless the dtype is set: on every CPU measured the fastest at one client (a step reads
    98 MB of blocks, not 269 MB of bfloat16), on AVX512-BF16 too, where it serves 1.6x the bfloat16 kernels at one
    client and, with the VNNI dot products, as fast or faster at 8 and 16 (docs/benchmarks.md)."""
    if config.weights == "q4":
        return "q4", ""
    if config.weights == "exact":
        if gguf is None or config.dtype not in ("auto", "float32"):
            return "", "the model's own forward" + ("" if gguf is None else f" in the configured {config.dtype}")
        return "exact", ""
    if gguf is None:
        return "", "no 4-bit blocks for this model"
    if config.dtype != "auto":
        return "", "weights=auto keeps a configured dtype exact"
    return "q4", ""


def _family_of(model_path: str, model_config) -> dict:
    """ModelInfo's architecture and weight types: a prepared GGUF's, else the folder's model_type."""
    record = source_record(Path(model_path)) or {}
    types = record.get("types") if isinstance(record.get("types"), dict) else {}
    return {"architecture": str(record.get("architecture") or getattr(model_config, "model_type", "")),
            "weight_types": tuple((str(name), int(count)) for name, count in types.items())}


def _greedy_tokens(rows: list[Row], logits: torch.Tensor) -> torch.Tensor | None:
    """Every row's argmax in one pass, if some row is plain greedy (the same token its sampler would pick: argmax
    of the same values; one call instead of a float copy and an argmax per row)."""
    if not any(row.sampler.is_plain_greedy for row in rows):
        return None
    return logits[:len(rows)].float().argmax(dim=-1)  # bfloat16's argmax is 3x slower than the copy and float's


def _to_host(tokens: list[torch.Tensor]) -> list[int]:
    """One device-to-host copy for the whole batch's tokens (on CUDA, one wait for the GPU per step)."""
    return torch.stack(tokens).tolist() if tokens else []


def _cost_units(start: int, num_tokens: int) -> float:
    """A chunk's cost in units of one prompt token at context 0: each token also attends to all before it."""
    mean_context = start + num_tokens / 2
    return num_tokens * (1 + mean_context / ATTENTION_COST_SCALE)


def _tokens_within(units: float, start: int) -> int:
    """The most tokens from `start` whose chunk costs at most `units` (`_cost_units`: n (1 + (start + n / 2) / S),
    solved for n)."""
    half_per_scale, linear = 0.5 / ATTENTION_COST_SCALE, 1 + start / ATTENTION_COST_SCALE
    return int((math.sqrt(linear * linear + 4 * half_per_scale * max(0.0, units)) - linear) / (2 * half_per_scale))


def planned_chunk_size(num_computed: int, num_left: int, chunk_tokens: int, chunk_units: float) -> int:
    """A prompt's next chunk from its own progress only: about `chunk_units` of cost, so fewer tokens as each
    token attends to more context (every chunk costs about the same: bounded gaps beside streams), and at most
    `chunk_tokens`."""
    affordable = int(chunk_units / (1 + num_computed / ATTENTION_COST_SCALE))
    return min(num_left, chunk_tokens, max(MIN_CHUNK_TOKENS, affordable))


def _kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _prompt_views(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A prompt cache's one sequence per layer as [kv_heads, positions, head_dim]."""
    return [(keys[0], values[0]) for keys, values in _kv(cache)]


def _context_length(model_config, configured: int) -> int:
    native = getattr(model_config, "max_position_embeddings", None) or DEFAULT_CONTEXT
    return min(configured, native) if configured else native


def _eos_token_ids(model) -> tuple[int, ...]:
    return eos_ids(*(getattr(source, "eos_token_id", None) for source in (model.config, model.generation_config)))

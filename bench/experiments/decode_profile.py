"""Where a decode step's time goes, and which kernels to compute it with on this host.

    python -m bench.experiments.decode_profile [--threads 1] [--dtype bfloat16] [--steps 20] [--skip-before]
    python -m bench.experiments.decode_profile --paths [--compile] [--threads 2]
    python -m bench.experiments.decode_profile --prefill [--against OTHER/q4_kernels.c]
    python -m bench.experiments.decode_profile --matmuls [--rows 1,4,16,64] [--against OTHER/q4_kernels.c]

A served token costs one decode step, so these tables decide the backend's forward and its kernels. By default: ms
per step for each design of the step (from the one the backend started from to lockstep's kernels in one C call
with their helper thread), the layer-by-layer steps split into their parts, and the per-token costs outside the
forward, all in one process so that the ratios compare even on a busy machine. --paths: one step's weight matmuls
on every way this host offers to compute them. --prefill: a prompt chunk on the 4-bit path at the start of a
prompt and deep in one (what a multi-turn chat's next turn prefills after its cached history). --matmuls: one
step's weight matmuls on the 4-bit kernels as the forward reads them, by rows, on both activations. Times are
wall-clock medians beside the process CPU time (a much lower CPU time: other processes held the cores). The tables
and what they showed: docs/benchmarks.md.
"""
import argparse
import contextlib
import functools
import logging
import os
import statistics
import time
from unittest import mock

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from engine import EngineConfig
from engine.backends import fast_forward
from engine.backends.bf16 import load_bf16_kernels
from engine.backends.fast_forward import FastDecoder
from engine.backends.kv_cache import SlotKVCache, use_slot_attention
from engine.backends.sampler import TokenSampler
from engine.detokenizer import IncrementalDetokenizer
from engine.executor import ModelExecutor
from engine.messages import WorkerSampling
from engine.model_store import resolve_model

logger = logging.getLogger(__name__)

BATCHES = (1, 8, 16)
CONTEXTS = (64, 256, 1024)


def timed(step, num_steps: int) -> tuple[float, float]:
    """(median wall ms, mean CPU ms) per call of `step`, after two warm-up calls."""
    for _ in range(2):
        step()
    walls, cpu_started = [], time.process_time()
    for _ in range(num_steps):
        started = time.perf_counter()
        step()
        walls.append(time.perf_counter() - started)
    return statistics.median(walls) * 1e3, (time.process_time() - cpu_started) / num_steps * 1e3


def slot_stepper(model, batch: int, context: int, fast: FastDecoder | None = None):
    """A decode step over rows in slots, keys and values written in place: through the model's forward, or
    through `fast` (the backend's default for this model)."""
    config = model.config
    dtype = fast.q4.kv_dtype if fast is not None and fast.q4 is not None else model.dtype  # the 4-bit path's own
    cache = SlotKVCache(config.num_hidden_layers, config.num_key_value_heads,
                        config.hidden_size // config.num_attention_heads, dtype, torch.device("cpu"))
    shape = (1, config.num_key_value_heads, context, config.hidden_size // config.num_attention_heads)
    layers = [(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)) for _ in range(config.num_hidden_layers)]
    for _ in range(batch):
        cache.add_row(layers, context)
    tokens = torch.randint(100, 10_000, (max(batch, 2), 1))

    def step():
        position_ids, mask = cache.prepare_decode(min_rows=2)
        if fast is not None:
            fast.decode(tokens, position_ids, mask, cache)
        else:
            model(input_ids=tokens, attention_mask=mask, position_ids=position_ids, past_key_values=cache,
                  use_cache=True, logits_to_keep=1)
        cache.finish_decode()
        if max(cache.lengths) > context + 64:  # stay near the context being measured
            cache.lengths = [context] * batch
    return step


def padded_stepper(model, batch: int, context: int):
    """The replaced design: a DynamicCache that grows by torch.cat every step, a 2-D mask grown likewise."""
    state = {}

    def reset():
        cache = DynamicCache()
        model(input_ids=torch.randint(100, 10_000, (batch, context)), past_key_values=cache, use_cache=True,
              logits_to_keep=1)
        state.update(cache=cache, mask=torch.ones(batch, context, dtype=torch.long), position=context)

    reset()
    tokens = torch.randint(100, 10_000, (batch, 1))

    def step():
        state["mask"] = torch.cat([state["mask"], torch.ones(batch, 1, dtype=torch.long)], dim=1)
        position_ids = torch.full((batch, 1), state["position"])
        model(input_ids=tokens, attention_mask=state["mask"], position_ids=position_ids,
              past_key_values=state["cache"], use_cache=True, logits_to_keep=1)
        state["position"] += 1
    return step


def step_table(model, decoders: list[tuple[str, FastDecoder]], num_steps: int, skip_before: bool) -> list[str]:
    """ms per step of the design the backend started from, of the model's forward over the slot cache, and of
    each fast forward in `decoders` (the default last)."""
    names = ["before", "slots, model's forward"] + [name for name, _ in decoders]
    lines = ["| batch | context | " + " | ".join(f"{name}: ms/step (CPU ms) | tok/s" for name in names)
             + " | default vs before | default vs model's forward |",
             "|---:|---:|" + "---:|---:|" * len(names) + "---:|---:|"]
    for batch in BATCHES:
        for context in CONTEXTS:
            times = [(float("nan"), float("nan"))]
            if not skip_before:
                model.set_attn_implementation("sdpa")
                times = [timed(padded_stepper(model, batch, context), num_steps)]
            use_slot_attention(model)
            times += [timed(slot_stepper(model, batch, context, decoder), num_steps)
                      for decoder in [None] + [decoder for _, decoder in decoders]]
            cells = " | ".join(f"{wall:.1f} ({cpu:.1f}) | {batch / wall * 1e3:.0f}" for wall, cpu in times)
            default = times[-1][0]
            lines.append(f"| {batch} | {context} | {cells} | {times[0][0] / default:.2f}x "
                         f"| {times[1][0] / default:.2f}x |")
            logger.info(lines[-1])
    return lines


PARTS = {  # what is timed: (owner, attribute) wrapped with a wall-clock accumulator
    "weight matmuls (4 per layer + lm_head)": (fast_forward.Linear, "__call__"),
    "attention (one query per row over its slot)": (FastDecoder, "_attention"),
    "KV cache writes": (SlotKVCache, "update"),
    "rotary embedding": (fast_forward, "_rotate"),
}


def breakdown_table(model, decoder: FastDecoder, name: str, batch: int, num_steps: int) -> list[str]:
    """One fast step split into its parts by wall-clock wrappers (the kernels are C calls that torch.profiler does
    not see); the rest is norms, SiLU, residual adds, the embedding, and Python."""
    use_slot_attention(model)
    step = slot_stepper(model, batch, 256, decoder)
    wall, _ = timed(step, num_steps)
    spent = dict.fromkeys(PARTS, 0.0)
    with contextlib.ExitStack() as patches:
        for part, (owner, attribute) in PARTS.items():
            patches.enter_context(mock.patch.object(owner, attribute, _accumulating(getattr(owner, attribute),
                                                                                    spent, part)))
        instrumented, _ = timed(step, num_steps)
    spent = {part: seconds / (num_steps + 2) * 1e3 for part, seconds in spent.items()}  # timed() warms up twice
    lines = [f"{name}, batch {batch}, context 256: {wall:.1f} ms per step "
             f"({instrumented:.1f} instrumented).", "", "| part | ms per step | share |", "|---|---:|---:|"]
    for part, ms in spent.items():
        lines.append(f"| {part} | {ms:.1f} | {ms / instrumented:.0%} |")
    rest = max(0.0, instrumented - sum(spent.values()))
    lines.append(f"| the rest: norms, SiLU, residual adds, embedding, Python | {rest:.1f} "
                 f"| {rest / instrumented:.0%} |")
    return lines


def _accumulating(function, spent: dict[str, float], part: str):
    @functools.wraps(function)
    def timed_call(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[part] += time.perf_counter() - started
    return timed_call


def side_costs(model_path: str, model, dtype: str) -> list[str]:
    vocab = model.config.vocab_size
    logits = torch.randn(vocab).to(model.dtype)
    greedy = TokenSampler(WorkerSampling(), torch.device("cpu"))
    seeded = TokenSampler(WorkerSampling(temperature=0.8, top_p=0.9, seed=1), torch.device("cpu"))
    greedy_ms, _ = timed(lambda: greedy(logits), 200)
    seeded_ms, _ = timed(lambda: seeded(logits), 200)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    text_ids = tokenizer.encode("The quick brown fox jumps over the lazy dog; café, naïve, 日本語, 🎉. " * 40)
    detokenizer = IncrementalDetokenizer(tokenizer, stop=("\n\n",))
    started = time.perf_counter()
    for token_id in text_ids:
        detokenizer.add_token(token_id)
    detok_us = (time.perf_counter() - started) / len(text_ids) * 1e6
    executor = ModelExecutor(EngineConfig(model=model_path, dtype=dtype, threads=1), model_path)
    executor.start()
    try:
        echo_ms, _ = timed(lambda: executor.echo("x" * 200, timeout=10), 200)
    finally:
        executor.shutdown()
    return ["| cost | per |", "|---|---:|",
            f"| sampler, greedy (float copy + argmax of {vocab} logits) | {greedy_ms:.2f} ms per row |",
            f"| sampler, temperature + top-p + seeded draw | {seeded_ms:.2f} ms per row |",
            f"| worker round-trip (echo through the task and result queues) | {echo_ms:.2f} ms per step |",
            f"| incremental detokenizer in the parent, with a stop string | {detok_us:.0f} µs per token |"]


def paths_table(model, num_steps: int, with_compile: bool) -> list[str]:
    """ms for one decode step's weight matmuls on each path, at 1 / 8 / 16 rows (see the docstring)."""
    from engine.backends.q4 import Q4Weights, load_q4_kernels
    from engine.hardware import detect_host

    config, cache_dir = model.config, EngineConfig().cache_dir
    quantized = step_weights(Q4Weights.of_embedded_model(config, cache_dir))
    dense = [w.dequantized() for w in quantized]
    paths = {"float32 matmul (oneDNN/MKL)": _dense_path(dense, torch.float32),
             "bfloat16 matmul (oneDNN)": _dense_path(dense, torch.bfloat16),
             "int8 weight-only (_weight_int8pack_mm)": _int8_path(dense),
             "int4 weight-only (_weight_int4pack_mm_for_cpu, groups of 32)": _int4_path(dense, torch.float32),
             "int4 weight-only, bfloat16 activations (the same op)": _int4_path(dense, torch.bfloat16)}
    if with_compile:
        paths.update(_inductor_paths(dense, config))
    every_core, all_helpers = None, (os.cpu_count() or 1) - 1  # the 8-bit kernels on every core: their call cost
    for exact in (False, True):
        for helpers in (0, all_helpers):
            kernels = load_q4_kernels(cache_dir, helpers, exact)
            every_core = kernels if not exact and helpers == all_helpers else every_core
            if kernels is not None:  # the blocks laid out as the forward reads them
                activations, laid_out = "float32" if exact else "8-bit", [kernels.interleaved(w) for w in quantized]
                paths[f"lockstep 4-bit kernels, {activations} activations, {helpers + 1} thread(s)"] = \
                    lambda x, kernels=kernels, laid_out=laid_out: [kernels.linear(x[w.in_features], w)
                                                                   for w in laid_out]
    rows = [f"{detect_host().describe()}; flags: {' '.join(sorted(detect_host().flags & PATH_FLAGS))}", "",
            "| one decode step's weight matmuls, ms | 1 row | 8 rows | 16 rows |", "|---|---:|---:|---:|"]
    for name, run in paths.items():
        cells = []
        for batch in (1, 8, 16):
            inputs = {width: torch.randn(batch, width) for width in (config.hidden_size, config.intermediate_size)}
            try:
                wall, _ = timed(lambda: run(inputs), num_steps)
                cells.append(f"{wall:.1f}")
            except (RuntimeError, NotImplementedError) as exc:  # a path this torch build lacks
                cells.append(f"fails: {_reason(exc)[:60]}")
        rows.append(f"| {name} | {' | '.join(cells)} |")
    if every_core is not None:
        rows += ["", f"lockstep's rows make {len(quantized)} calls from Python, "
                     f"{_call_overhead_us(every_core, quantized[1]):.1f} µs each on a matmul of 8 columns and one row "
                     f"(a served step makes one C call for the whole step); the compiled rows one call."]
    return rows


def step_weights(blocks) -> list:
    """The weights a decode step multiplies by, in the forward's order: each layer's fused q/k/v, output, fused
    gate/up and down, then the lm_head (121 for the embedded model)."""
    return [w for layer in blocks.layers for w in (layer.qkv, layer.out, layer.gate_up, layer.down)] + [blocks.lm_head]


def _reason(exc: Exception) -> str:
    """The line of an exception that says why: dynamo wraps inductor's under "backend='inductor' raised:"."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return next((line for line in lines if not line.endswith("raised:")), type(exc).__name__)


def _call_overhead_us(kernels, weight) -> float:
    """µs a kernels.linear call costs beyond its arithmetic: the call on 8 of `weight`'s columns, one row."""
    from engine.backends.q4 import QuantizedWeight

    small = kernels.interleaved(QuantizedWeight(weight.blocks[:8].clone(), weight.format, 8, weight.in_features))
    x = torch.randn(1, weight.in_features)
    wall, _ = timed(lambda: [kernels.linear(x, small) for _ in range(1000)], 9)
    return wall  # ms per 1,000 calls: µs per call


def kernels_by_source(against: str | None, helpers: int, exact: bool) -> dict:
    """This tree's 4-bit kernels and, with `against`, those built from another q4_kernels.c (into a folder of its
    own), by name; a build that cannot run here is left out (the log says why)."""
    from pathlib import Path
    from tempfile import mkdtemp

    from engine.backends import q4

    loaded = {}
    for name, source in {"this tree": q4.SOURCE, **({against: Path(against)} if against else {})}.items():
        folder = EngineConfig().cache_dir if source == q4.SOURCE else mkdtemp()  # before SOURCE is patched
        with mock.patch.object(q4, "SOURCE", source):
            kernels = q4.load_q4_kernels(folder, helpers, exact)
        if kernels is not None:
            loaded[name] = kernels
    return loaded


PREFILL_CHUNK = 160
PREFILL_DEPTHS = (0, 800, 1700)


def prefill_table(model, num_steps: int, against: str | None = None) -> list[str]:
    """ms for a PREFILL_CHUNK-token prompt chunk on the 4-bit path after PREFILL_DEPTHS cached positions, on this
    tree's kernels and, with `against`, on those of another q4_kernels.c, calls alternated (this host's speed
    drifts: only an interleaved comparison says which is faster); the logits must be the same bits."""
    from engine.backends import q4

    weights = q4.Q4Weights.of_embedded_model(model.config, EngineConfig().cache_dir)
    weights.give_model_the_same_weights(model)
    ids = torch.randint(100, 20000, (max(PREFILL_DEPTHS) + PREFILL_CHUNK,), generator=torch.Generator().manual_seed(0))
    helpers, rows = (os.cpu_count() or 1) - 1, []
    for exact in (False, True):
        decoders = {}
        for name, kernels in kernels_by_source(against, helpers, exact).items():
            decoder = FastDecoder(model, q4=(kernels, weights))
            cache = decoder.new_prompt_cache(len(ids))
            decoder.prefill(ids[:max(PREFILL_DEPTHS)], 0, cache)
            decoders[name] = decoder, cache
        walls = {(name, depth): [] for name in decoders for depth in PREFILL_DEPTHS}
        for depth in PREFILL_DEPTHS:
            logits = {}
            for _ in range(num_steps):
                for name, (decoder, cache) in decoders.items():
                    started = time.perf_counter()
                    logits[name] = decoder.prefill(ids[depth:depth + PREFILL_CHUNK], depth, cache)
                    walls[name, depth].append(time.perf_counter() - started)
            if len({tuple(t.tolist()) for t in logits.values()}) > 1:
                raise AssertionError(f"the kernels disagree after {depth} positions")
        for name in decoders:
            cells = [f"{statistics.median(walls[name, depth]) * 1e3:.0f}" for depth in PREFILL_DEPTHS]
            rows.append(f"| {name}, {'float32' if exact else '8-bit'} activations, {helpers + 1} thread(s) | "
                        f"{' | '.join(cells)} |")
    header = " | ".join(f"after {depth} positions" for depth in PREFILL_DEPTHS)
    return [f"| {PREFILL_CHUNK}-token prompt chunk, ms | {header} |", "|---|" + "---:|" * len(PREFILL_DEPTHS), *rows]


def matmul_table(model, num_steps: int, rows_list: list[int], against: str | None = None) -> list[str]:
    """ms for one step's weight matmuls on the 4-bit kernels as the forward reads them (the interleaved blocks),
    8-bit and float32 activations, at each row count, every core; with `against`, another q4_kernels.c's calls
    alternated with this tree's, and their outputs must be the same bits."""
    from engine.backends import q4

    config = model.config
    blocks = q4.Q4Weights.of_embedded_model(config, EngineConfig().cache_dir)
    helpers, rows_out = (os.cpu_count() or 1) - 1, []
    for exact in (False, True):
        runs = {}
        for name, kernels in kernels_by_source(against, helpers, exact).items():
            runs[name] = kernels, [kernels.interleaved(w) for w in step_weights(blocks)]
        for rows in rows_list:
            inputs = {width: torch.randn(rows, width) for width in (config.hidden_size, config.intermediate_size)}
            walls, outputs = {name: [] for name in runs}, {}
            for _ in range(num_steps):
                for name, (kernels, weights) in runs.items():
                    started = time.perf_counter()
                    outputs[name] = [kernels.linear(inputs[w.in_features], w) for w in weights]
                    walls[name].append(time.perf_counter() - started)
            first = next(iter(outputs.values()))
            if not all(torch.equal(a, b) for other in outputs.values() for a, b in zip(first, other)):
                raise AssertionError(f"the kernels disagree at {rows} rows")
            for name in runs:
                rows_out.append(f"| {name}, {'float32' if exact else '8-bit'} activations | {rows} | "
                                f"{statistics.median(walls[name]) * 1e3:.2f} |")
    return [f"one step's weight matmuls, {helpers + 1} thread(s)", "",
            "| kernels | rows | ms |", "|---|---:|---:|", *rows_out]


PATH_FLAGS = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16", "asimd", "bf16"}


def _dense_path(weights: list[torch.Tensor], dtype: torch.dtype):
    cast = [w.to(dtype) for w in weights]
    return lambda x: [torch.nn.functional.linear(x[w.shape[1]].to(dtype), w) for w in cast]


def _int8_weights(weights: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-output-channel int8 and its scales, as torchao's int8 weight-only quantization makes them."""
    scales = [w.abs().amax(dim=1).clamp(min=1e-12) / 127 for w in weights]
    return [(torch.round(w / s[:, None]).to(torch.int8), s) for w, s in zip(weights, scales)]


def _int8_path(weights: list[torch.Tensor]):
    """int8 weight-only, as torchao calls ATen."""
    ints = _int8_weights(weights)
    return lambda x: [torch._weight_int8pack_mm(x[w.shape[1]], w, s) for w, s in ints]


def _int4_weights(weights: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Asymmetric int4 in groups of 32 (tinygemm's layout: (q - 8) * scale + zero), packed for ATen's CPU op."""
    packed = []
    for w in weights:
        groups = w.view(w.shape[0], -1, 32)
        low, high = groups.amin(-1), groups.amax(-1)
        scale = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(w.shape)
        zero = low + 8 * scale
        scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [K / 32, N, 2]
        packed.append((torch._convert_weight_to_int4pack_for_cpu(q, 1), scales_and_zeros))
    return packed


def _int4_path(weights: list[torch.Tensor], dtype: torch.dtype):
    """int4 weight-only in groups of 32, as torchao calls ATen on CPU (its recipe: bfloat16 activations)."""
    packed = [(p, sz.to(dtype), w.shape[1]) for (p, sz), w in zip(_int4_weights(weights), weights)]
    return lambda x: [torch._weight_int4pack_mm_for_cpu(x[k].to(dtype), p, 32, sz) for p, sz, k in packed]


class _ConstantWeights(torch.nn.Module):
    """A step's weight matmuls with the weights as module buffers: inductor's freezing makes them constants, and
    only on constant weights does it choose (and pack for) its own C++ GEMM templates."""

    def __init__(self, weights: list[tuple[torch.Tensor, ...]], in_features: list[int], matmul):
        super().__init__()
        self.matmul, self.in_features = matmul, in_features
        self.parts = [[f"w{i}_{j}" for j in range(len(tensors))] for i, tensors in enumerate(weights)]
        for names, tensors in zip(self.parts, weights):
            for name, tensor in zip(names, tensors):
                self.register_buffer(name, tensor)

    def forward(self, hidden: torch.Tensor, intermediate: torch.Tensor) -> list[torch.Tensor]:
        by_width = {hidden.shape[-1]: hidden, intermediate.shape[-1]: intermediate}
        return [self.matmul(by_width[k], *(getattr(self, name) for name in names))
                for names, k in zip(self.parts, self.in_features)]


def _inductor_paths(weights: list[torch.Tensor], config) -> dict:
    """torch.compile of the step's matmuls as torchao's CPU recipe sets inductor up (freezing, max-autotune), on
    inductor's own C++ GEMM templates only (float32; int8 and int4 weight-only: the rows above are ATen's ops). Left
    to choose, autotuning would time every one of the 121 matmuls against ATen's, two seconds each. Each batch size
    compiles once, at its first (warm-up) call."""
    in_features = [w.shape[1] for w in weights]
    recipes = {"float32 matmul, torch.compile (inductor's C++ GEMM template)":
               ([(w,) for w in weights], torch.nn.functional.linear),
               "int8 weight-only, torch.compile (inductor's C++ GEMM template)":
               (_int8_weights(weights), lambda x, w, s: torch.nn.functional.linear(x, w.to(x.dtype)) * s),
               # its int4 template takes bfloat16 activations only (as torchao's CPU int4 recipe feeds it)
               "int4 weight-only, bfloat16 activations, torch.compile (inductor's C++ GEMM template)":
               ([(w, sz.to(torch.bfloat16)) for w, sz in _int4_weights(weights)],
                lambda x, w, sz: torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), w, 32, sz))}
    paths = {}
    for name, (tensors, matmul) in recipes.items():
        compiled = torch.compile(_ConstantWeights(tensors, in_features, matmul).eval(), dynamic=False)

        def run(x, compiled=compiled):
            with torch._inductor.config.patch(freezing=True, max_autotune=True, max_autotune_gemm_backends="CPP"):
                return compiled(x[config.hidden_size], x[config.intermediate_size])
        paths[name] = run
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip-before", action="store_true", help="only the slot cache in table 1")
    parser.add_argument("--paths", action="store_true", help="the weight matmuls on every path this host offers")
    parser.add_argument("--compile", action="store_true",
                        help="with --paths: also torch.compile's (inductor's) float32, int8 and int4 matmuls")
    parser.add_argument("--prefill", action="store_true", help="a prompt chunk on the 4-bit path, shallow and deep")
    parser.add_argument("--matmuls", action="store_true", help="one step's 4-bit matmuls by rows, both activations")
    parser.add_argument("--rows", default="1,4,16,64", help="with --matmuls: the row counts")
    parser.add_argument("--against", help="with --prefill or --matmuls: another q4_kernels.c to alternate with "
                                          "this tree's")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model_path = resolve_model(EngineConfig())
    if args.paths:
        torch.set_num_threads(args.threads)
        with torch.inference_mode():
            config_only = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            print("\n".join(paths_table(config_only, args.steps, args.compile)))
        return
    if args.matmuls:
        torch.set_num_threads(1)
        with torch.inference_mode():
            config_only = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            rows = [int(r) for r in args.rows.split(",")]
            print("\n".join(matmul_table(config_only, args.steps, rows, args.against)))
        return
    if args.prefill:
        torch.set_num_threads(1)  # as in the worker: torch's own spinning threads would take the kernels' helper's core
        with torch.inference_mode():
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
            print("\n".join(prefill_table(model, args.steps, args.against)))
        return
    # Side costs first: the executor forks a worker, which must happen before this process starts torch threads.
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype)).eval()
    torch.set_num_threads(1)
    with torch.inference_mode():
        side = side_costs(model_path, model, args.dtype)
        torch.set_num_threads(args.threads)
        # Each fuses the model's projections (views: its forward computes the same).
        decoders = [("fast forward, oneDNN", FastDecoder(model))]
        loaded = load_bf16_kernels(EngineConfig().cache_dir) if args.dtype == "bfloat16" else None
        if loaded:
            helper_rows = EngineConfig().kernel_helper_rows
            decoders += [("kernels, layer by layer", FastDecoder(model, loaded, whole_step_in_c=False)),
                         ("kernels, one call", FastDecoder(model, loaded)),
                         (f"kernels, one call, helper up to {helper_rows} rows (default)",
                          FastDecoder(model, loaded, helper_rows))]
        steps = step_table(model, decoders, args.steps, args.skip_before)
        breakdowns = [line for name, decoder in decoders[:2] for batch in (8, 16)  # the per-layer Python ones
                      for line in breakdown_table(model, decoder, name, batch, args.steps) + [""]]
    print(f"\n{args.dtype}, {args.threads} torch thread(s)\n")
    print("\n".join(steps + [""] + breakdowns + side))


if __name__ == "__main__":
    main()

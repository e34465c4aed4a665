"""Where a decode step's time goes in the transformers backend (issue 10, item 3).

    python -m bench.decode_profile [--threads 1] [--dtype bfloat16] [--steps 20] [--skip-before]

Three tables, in one process so the ratios compare even on a busy machine:
1. ms per decode step and tokens/s, batch 1 / 8 / 16 at contexts 64 / 256 / 1,024: the design the
   backend started from (a DynamicCache concatenated every step, rows left-padded to the longest, a
   2-D mask grown by a column per step, SDPA attention), the slot KV cache through the model's
   forward, and the slot KV cache through the fast forward (engine/backends/fast_decode.py, the
   default for this model);
2. one fast step (batch 8, context 256) split by operator class with torch.profiler: the weight
   matmuls, attention, cache writes, other tensor ops, and the rest (Python, dispatch);
3. the per-token costs outside the forward: the sampler per row, the worker round-trip (a
   forked worker's echo), the parent's incremental detokenizer.
Times are wall-clock medians with the process CPU time beside them: when the CPU time is much
lower, other processes held the cores.
"""
import argparse
import logging
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from engine import EngineConfig
from engine.backends.fast_decode import FastDecoder
from engine.backends.kv_cache import SlotKVCache, use_slot_attention
from engine.backends.sampler import TokenSampler
from engine.detokenizer import IncrementalDetokenizer
from engine.executor import ModelExecutor
from engine.messages import WorkerSampling
from engine.model_store import resolve_model

logger = logging.getLogger(__name__)

BATCHES = (1, 8, 16)
CONTEXTS = (64, 256, 1024)
MATMULS = {"aten::mm", "aten::addmm", "mkldnn::_linear_pointwise"}
ATTENTION = {"aten::bmm", "aten::_softmax", "aten::_scaled_dot_product_flash_attention_for_cpu",
             "aten::_scaled_dot_product_attention_math"}
CACHE = {"aten::cat", "aten::_index_put_impl_", "aten::index_put_"}


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
    cache = SlotKVCache(config.num_hidden_layers, config.num_key_value_heads,
                        config.hidden_size // config.num_attention_heads, model.dtype, torch.device("cpu"))
    shape = (1, config.num_key_value_heads, context, config.hidden_size // config.num_attention_heads)
    layers = [(torch.randn(shape).to(model.dtype), torch.randn(shape).to(model.dtype))
              for _ in range(config.num_hidden_layers)]
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


def step_table(model, fast: FastDecoder, num_steps: int, skip_before: bool) -> list[str]:
    lines = ["| batch | context | before: ms/step (CPU ms) | tok/s | slots, model's forward: ms/step (CPU ms) "
             "| tok/s | slots, fast forward: ms/step (CPU ms) | tok/s | fast vs before | fast vs model's forward |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for batch in BATCHES:
        for context in CONTEXTS:
            before = (float("nan"), float("nan"))
            if not skip_before:
                model.set_attn_implementation("sdpa")
                before = timed(padded_stepper(model, batch, context), num_steps)
            use_slot_attention(model)
            slots = timed(slot_stepper(model, batch, context), num_steps)
            fastest = timed(slot_stepper(model, batch, context, fast), num_steps)
            lines.append(f"| {batch} | {context} | {before[0]:.1f} ({before[1]:.1f}) | {batch / before[0] * 1e3:.0f} "
                         f"| {slots[0]:.1f} ({slots[1]:.1f}) | {batch / slots[0] * 1e3:.0f} "
                         f"| {fastest[0]:.1f} ({fastest[1]:.1f}) | {batch / fastest[0] * 1e3:.0f} "
                         f"| {before[0] / fastest[0]:.2f}x | {slots[0] / fastest[0]:.2f}x |")
            logger.info(lines[-1])
    return lines


def breakdown_table(model, fast: FastDecoder, num_steps: int) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    use_slot_attention(model)
    step = slot_stepper(model, 8, 256, fast)
    wall, _ = timed(step, num_steps)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(num_steps):
            step()
    classes = {"weight matmuls (4 fused per layer + lm_head)": 0.0, "attention (2 matmuls + softmax per layer)": 0.0,
               "KV cache writes": 0.0, "other tensor ops (norms, RoPE, SiLU, adds, casts)": 0.0}
    names = list(classes)
    for event in profiler.key_averages():
        key = (names[0] if event.key in MATMULS else names[1] if event.key in ATTENTION
               else names[2] if event.key in CACHE else names[3])
        classes[key] += event.self_cpu_time_total / 1e3 / num_steps
    profiled_ops = sum(classes.values())
    lines = [f"The fast forward, batch 8, context 256: {wall:.1f} ms per step unprofiled.", "",
             "| part | ms per step | share |", "|---|---:|---:|"]
    for name, ms in classes.items():
        lines.append(f"| {name} | {ms * wall / max(profiled_ops, wall):.1f} | {ms / max(profiled_ops, wall):.0%} |")
    rest = max(0.0, wall - profiled_ops)
    lines.append(f"| Python and dispatch (unprofiled wall minus operator time) | {rest:.1f} | {rest / wall:.0%} |")
    return lines


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip-before", action="store_true", help="only the slot cache in table 1")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model_path = resolve_model(EngineConfig())
    # Side costs first: the executor forks a worker, which must happen before this process starts torch threads.
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, args.dtype)).eval()
    torch.set_num_threads(1)
    with torch.inference_mode():
        side = side_costs(model_path, model, args.dtype)
        torch.set_num_threads(args.threads)
        fast = FastDecoder(model)  # fuses the model's projections (views: its forward computes the same)
        steps = step_table(model, fast, args.steps, args.skip_before)
        breakdown = breakdown_table(model, fast, args.steps)
    print(f"\n{args.dtype}, {args.threads} torch thread(s)\n")
    print("\n".join(steps + [""] + breakdown + [""] + side))


if __name__ == "__main__":
    main()

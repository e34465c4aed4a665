"""Throughput benchmark: lockstep's engine against raw `model.generate`, the original no-cache loop, and vLLM.

Same model, dtype and thread count for every row. The baseline lives in a spawned child (the
engine's parent must not run torch before it forks) with its model loaded once; baseline and
engine runs alternate, so a slow minute of a shared machine hits both, and each ratio is the
median of the per-pair ratios over `--repeats` pairs.

    python -m bench.throughput [--tokens 128] [--backends hf,vllm] [--dtype bfloat16] [--repeats 3]
"""
import argparse
import logging
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from engine import EngineConfig, LLMEngine, SamplingParams

logger = logging.getLogger("bench")

PROMPT = "Write a long story about a dragon who learns to cook. Chapter {}:"
CONCURRENCY = (1, 8, 16)


def prompts(n: int) -> list[str]:
    return [PROMPT.format(i + 1) for i in range(n)]


# -- the baseline, in a spawned child ------------------------------------------------------------------------

_baseline = {}


def load_baseline(model_dir: str, dtype: str, threads: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    _baseline["model"] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    _baseline["tokenizer"] = AutoTokenizer.from_pretrained(model_dir, padding_side="left")


def raw_generate(batch: int, tokens: int, use_cache: bool = True) -> float:
    """tokens/s of HF generate on `batch` left-padded prompts (use_cache=False: the original's recompute)."""
    model, tokenizer = _baseline["model"], _baseline["tokenizer"]
    inputs = tokenizer(prompts(batch), return_tensors="pt", padding=True)
    settings = dict(do_sample=False, use_cache=use_cache, pad_token_id=tokenizer.pad_token_id)
    model.generate(**inputs, max_new_tokens=2, **settings)  # warm-up for this shape
    start = time.perf_counter()
    out = model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, **settings)
    return (out.shape[1] - inputs["input_ids"].shape[1]) * batch / (time.perf_counter() - start)


# -- the engine ------------------------------------------------------------------------------------------------

def engine_burst(engine: LLMEngine, concurrency: int, tokens: int) -> dict:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outputs = list(pool.map(lambda p: engine.submit(p, params).result(), prompts(concurrency)))
    elapsed = time.perf_counter() - start
    return {"tokens_per_s": sum(o.usage.completion_tokens for o in outputs) / elapsed,
            "ttft_ms": statistics.median(o.timings.ttft_s * 1000 for o in outputs)}


def compare(engine: LLMEngine, baseline, args) -> dict[int, dict]:
    """Alternate baseline and engine runs at each concurrency; medians of tokens/s, TTFT and ratios."""
    engine.generate(prompts(1), SamplingParams(max_tokens=4))  # warm-up
    rows = {}
    for c in CONCURRENCY:
        pairs = [(baseline.apply(raw_generate, (c, args.tokens)), engine_burst(engine, c, args.tokens))
                 for _ in range(args.repeats)]
        rows[c] = {"raw": statistics.median(raw for raw, _ in pairs),
                   "tokens_per_s": statistics.median(run["tokens_per_s"] for _, run in pairs),
                   "ttft_ms": statistics.median(run["ttft_ms"] for _, run in pairs),
                   "ratio": statistics.median(run["tokens_per_s"] / raw for raw, run in pairs)}
    return rows


def table(args, recompute: tuple[float, float], results: dict[str, dict[int, dict]]) -> str:
    lines = [f"SmolLM2-135M-Instruct, {args.dtype}, {args.threads} threads, {args.tokens} tokens per request, "
             f"median of {args.repeats} alternating runs", "",
             "| run | concurrent requests | tokens/s | raw generate tokens/s | vs raw generate | median TTFT ms |",
             "|---|---:|---:|---:|---:|---:|"]
    raw_1, no_cache = recompute
    lines.append(f"| original no-KV recompute ({args.recompute_tokens} tokens) | 1 | {no_cache:.1f} | {raw_1:.1f} | "
                 f"{no_cache / raw_1:.2f}x | - |")
    for backend, rows in results.items():
        for c, r in rows.items():
            lines.append(f"| lockstep engine, {backend} | {c} | {r['tokens_per_s']:.1f} | {r['raw']:.1f} | "
                         f"{r['ratio']:.2f}x | {r['ttft_ms']:.0f} |")
    for backend, rows in results.items():
        single = rows[1]["tokens_per_s"]
        lines.append(f"\n{backend}: 8 concurrent / 1 request = {rows[8]['tokens_per_s'] / single:.2f}x; "
                     f"16 / 1 = {rows[16]['tokens_per_s'] / single:.2f}x")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--backends", default="hf", help="comma list: hf,vllm")
    parser.add_argument("--recompute-tokens", type=int, default=64, help="tokens for the no-cache baseline")
    parser.add_argument("--repeats", type=int, default=3, help="alternating baseline/engine pairs per number")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)

    from engine.model_store import resolve_model

    model_dir = resolve_model(EngineConfig())
    context = multiprocessing.get_context("spawn")
    with context.Pool(1, initializer=load_baseline, initargs=(model_dir, args.dtype, args.threads)) as baseline:
        recompute = (baseline.apply(raw_generate, (1, args.recompute_tokens)),
                     baseline.apply(raw_generate, (1, args.recompute_tokens, False)))
        results = {}
        for backend in args.backends.split(","):
            engine = LLMEngine(EngineConfig(backend=backend, dtype=args.dtype, threads=args.threads,
                                            max_batch_size=max(CONCURRENCY))).start()
            try:
                results[backend] = compare(engine, baseline, args)
            finally:
                engine.shutdown()
    logger.info(table(args, recompute, results))


if __name__ == "__main__":
    main()

"""Throughput benchmark: lockstep's engine against raw `model.generate`, the original no-cache loop, and vLLM.

Every number in one table comes from one run on the same model, dtype and thread count; each is the median of
`--repeats` timed runs. Baselines run in a spawned child (the engine's parent must not run torch before it forks).

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


def prompts(n: int) -> list[str]:
    return [PROMPT.format(i + 1) for i in range(n)]


# -- baselines (run in a spawned child) -------------------------------------------------------------------

def raw_generate(model_dir: str, dtype: str, threads: int, batch: int, tokens: int, use_cache: bool,
                 repeats: int) -> float:
    """tokens/s of HF generate on `batch` left-padded prompts (use_cache=False: the original's recompute)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    inputs = tokenizer(prompts(batch), return_tensors="pt", padding=True)
    settings = dict(do_sample=False, use_cache=use_cache, pad_token_id=tokenizer.pad_token_id)
    model.generate(**inputs, max_new_tokens=4, **settings)  # warm-up

    def timed() -> float:
        start = time.perf_counter()
        out = model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, **settings)
        return (out.shape[1] - inputs["input_ids"].shape[1]) * batch / (time.perf_counter() - start)

    return statistics.median(timed() for _ in range(repeats))


def run_baseline(**kwargs) -> float:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(raw_generate, kwds=kwargs)


# -- the engine ------------------------------------------------------------------------------------------

def engine_burst(engine: LLMEngine, concurrency: int, tokens: int) -> dict:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        outputs = list(pool.map(lambda p: engine.submit(p, params).result(), prompts(concurrency)))
    elapsed = time.perf_counter() - start
    generated = sum(o.usage.completion_tokens for o in outputs)
    return {"tokens_per_s": generated / elapsed,
            "ttft_ms": statistics.median(o.timings.ttft_s * 1000 for o in outputs)}


def engine_run(engine: LLMEngine, concurrency: int, tokens: int, repeats: int) -> dict:
    """The burst whose tokens/s is the median of `repeats`."""
    engine.generate(prompts(1), SamplingParams(max_tokens=4))  # warm-up
    bursts = sorted((engine_burst(engine, concurrency, tokens) for _ in range(repeats)),
                    key=lambda r: r["tokens_per_s"])
    return bursts[len(bursts) // 2]


def bench_backend(backend: str, args, concurrencies: list[int]) -> dict[int, dict]:
    config = EngineConfig(backend=backend, dtype=args.dtype, threads=args.threads,
                          max_batch_size=max(concurrencies))
    engine = LLMEngine(config).start()
    try:
        return {c: engine_run(engine, c, args.tokens, args.repeats) for c in concurrencies}
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--backends", default="hf", help="comma list: hf,vllm")
    parser.add_argument("--recompute-tokens", type=int, default=64, help="tokens for the no-cache baseline")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per number (the median is shown)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)

    from engine.model_store import resolve_model

    model_dir = resolve_model(EngineConfig())
    base = dict(model_dir=model_dir, dtype=args.dtype, threads=args.threads, tokens=args.tokens,
                repeats=args.repeats)
    raw = {c: run_baseline(batch=c, use_cache=True, **base) for c in (1, 8, 16)}
    recompute = run_baseline(batch=1, use_cache=False, **{**base, "tokens": args.recompute_tokens})
    results = {b: bench_backend(b, args, [1, 8, 16]) for b in args.backends.split(",")}

    lines = [f"model SmolLM2-135M-Instruct, {args.dtype}, {args.threads} threads, {args.tokens} tokens per request, "
             f"median of {args.repeats} runs",
             "", "| run | concurrent requests | tokens/s | vs raw generate (same batch) | median TTFT ms |",
             "|---|---:|---:|---:|---:|"]
    for c, tps in raw.items():
        lines.append(f"| raw model.generate (KV cache) | {c} | {tps:.1f} | 1.00x | - |")
    lines.append(f"| original no-KV recompute ({args.recompute_tokens} tokens) | 1 | {recompute:.1f} | "
                 f"{recompute / raw[1]:.2f}x | - |")
    for backend, by_concurrency in results.items():
        for c, r in by_concurrency.items():
            lines.append(f"| lockstep engine, {backend} | {c} | {r['tokens_per_s']:.1f} | "
                         f"{r['tokens_per_s'] / raw[c]:.2f}x | {r['ttft_ms']:.0f} |")
    for backend, by_concurrency in results.items():
        lines.append(f"\n{backend}: 8 concurrent / 1 request = "
                     f"{by_concurrency[8]['tokens_per_s'] / by_concurrency[1]['tokens_per_s']:.2f}x; "
                     f"16 / 1 = {by_concurrency[16]['tokens_per_s'] / by_concurrency[1]['tokens_per_s']:.2f}x")
    logger.info("\n".join(lines))


if __name__ == "__main__":
    main()

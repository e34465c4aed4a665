"""Greedy drift under load, and what batch invariance costs (issue 10, item 4).

    python -m bench.drift [--requests 32] [--max-tokens 64] [--clients 16] [--threads 1]

For `batch_invariant` on and off (each with its own engine, bfloat16, the embedded model): every
prompt generated alone (one at a time), then all of them with `--clients` in flight at once,
joining and leaving as others finish. Reports the share of greedy answers that differ from the
same prompt alone, and output tokens/s of both phases (the alone phase is the one-row decode that
invariance pads to two rows; the loaded phase includes its prompt-chunk plan).
"""
import argparse
import logging
import threading
import time

from engine import EngineConfig, LLMEngine, SamplingParams

from .serve_data import BUILTIN_PROMPTS

logger = logging.getLogger(__name__)


def prompts(count: int) -> list[str]:
    return [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)].format(n=i + 1) for i in range(count)]


def run_loaded(engine: LLMEngine, texts: list[str], sampling: SamplingParams, clients: int) -> dict[str, tuple]:
    """`clients` closed-loop clients share the prompts; each sends its next one when the last finished."""
    results, lock, next_index = {}, threading.Lock(), iter(range(len(texts)))

    def client() -> None:
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            results[texts[index]] = engine.submit(texts[index], sampling).result(timeout=1800).output_token_ids

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def measure(invariant: bool, texts: list[str], max_tokens: int, clients: int, threads: int) -> dict:
    config = EngineConfig(dtype="bfloat16", threads=threads, max_batch_size=clients, batch_invariant=invariant)
    engine = LLMEngine(config).start()
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    try:
        started = time.perf_counter()
        alone = {text: engine.generate([text], sampling)[0].output_token_ids for text in texts}
        alone_s = time.perf_counter() - started
        started = time.perf_counter()
        loaded = run_loaded(engine, texts, sampling, clients)
        loaded_s = time.perf_counter() - started
    finally:
        engine.shutdown()
    differing = sum(loaded[text] != alone[text] for text in texts)
    tokens = len(texts) * max_tokens
    return {"invariant": invariant, "differing": differing, "requests": len(texts),
            "alone_tok_s": tokens / alone_s, "loaded_tok_s": tokens / loaded_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    texts = prompts(args.requests)
    rows = [measure(invariant, texts, args.max_tokens, args.clients, args.threads) for invariant in (False, True)]
    print(f"\n{args.requests} greedy requests, {args.max_tokens} tokens each, bfloat16, {args.threads} thread(s); "
          f"loaded: {args.clients} clients\n")
    print("| batch_invariant | answers differing from alone | alone tok/s | loaded tok/s |\n|---|---:|---:|---:|")
    for row in rows:
        print(f"| {'on' if row['invariant'] else 'off'} | {row['differing']} / {row['requests']} "
              f"({row['differing'] / row['requests']:.0%}) | {row['alone_tok_s']:.1f} | {row['loaded_tok_s']:.1f} |")


if __name__ == "__main__":
    main()

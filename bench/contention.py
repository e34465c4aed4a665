"""Latency of one request with the worker's torch threads competing for the cores.

    python -m bench.contention --threads 2     # then --threads 1, or OMP_WAIT_POLICY=PASSIVE ... --threads 2

Times 64 greedy tokens idle, then twice beside one CPU-burning process per core.
"""
import argparse
import logging
import multiprocessing
import os
import time

from engine import EngineConfig, LLMEngine, SamplingParams

logger = logging.getLogger("bench")


def burn_cpu(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10000))


def timed_request(engine: LLMEngine, tokens: int) -> float:
    start = time.perf_counter()
    engine.generate(["Tell me a story."], SamplingParams(max_tokens=tokens, ignore_eos=True))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=0, help="worker torch threads (0 = the engine default)")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    engine = LLMEngine(EngineConfig(threads=args.threads)).start()
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    burners = [context.Process(target=burn_cpu, args=(stop,)) for _ in range(os.cpu_count() or 1)]
    try:
        engine.generate(["warm-up"], SamplingParams(max_tokens=4))
        idle = timed_request(engine, args.tokens)
        for burner in burners:
            burner.start()
        busy = [timed_request(engine, args.tokens) for _ in range(2)]
    finally:
        stop.set()
        for burner in burners:
            burner.join(10)
        engine.shutdown()
    logger.info("threads=%d OMP_WAIT_POLICY=%s: %d tokens idle %.2f s, beside %d busy processes %s s",
                engine.config.num_threads, os.environ.get("OMP_WAIT_POLICY", "-"), args.tokens, idle,
                len(burners), " / ".join(f"{t:.2f}" for t in busy))


if __name__ == "__main__":
    main()

"""How long short requests wait while one long request runs (admission, not the streams' gaps:
bench.experiments.long_prompt).

    python -m bench.experiments.beside_long [--clients 10] [--long-prompt-tokens 7900] [--long-max-tokens 290]

Closed-loop clients send short requests (a 30-token prompt, 32 tokens) for a few seconds alone, then while one long
request (most of the context) is prefilled and decodes. The table gives the short requests' latency, submit to last
token, in both phases, and the long request's own time: the engine's defaults, in process.
"""
import argparse
import logging
import statistics
import threading
import time

from engine import EngineConfig, LLMEngine, SamplingParams

logger = logging.getLogger(__name__)

SHORT = SamplingParams(max_tokens=32, ignore_eos=True)


def short_prompt(client: int, request: int) -> list[int]:
    return [(17 * i + 101 * client + 7 * request) % 20000 + 100 for i in range(30)]


def measure(config: EngineConfig, num_clients: int, long_prompt_tokens: int, long_max_tokens: int,
            alone_s: float) -> dict:
    engine = LLMEngine(config).start()
    latencies: list[tuple[float, float]] = []  # (seconds, when it ended)
    is_done = threading.Event()

    def client(index: int) -> None:
        request = 0
        while not is_done.is_set():
            started = time.monotonic()
            engine.submit(prompt_token_ids=short_prompt(index, request), sampling=SHORT).result()
            latencies.append((time.monotonic() - started, time.monotonic()))
            request += 1

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(num_clients)]
    for thread in threads:
        thread.start()
    try:
        is_done.wait(alone_s)
        long_started = time.monotonic()
        long_ids = [(13 * i) % 20000 + 100 for i in range(long_prompt_tokens)]
        long = engine.submit(prompt_token_ids=long_ids, sampling=SamplingParams(max_tokens=long_max_tokens,
                                                                                 ignore_eos=True)).result()
        long_ended = time.monotonic()
    finally:
        is_done.set()
        for thread in threads:
            thread.join(600)
        info = engine.info
        engine.shutdown()
    alone = sorted(s for s, at in latencies if at < long_started)
    beside = sorted(s for s, at in latencies if long_started + 1.0 < at <= long_ended)  # sent after it came
    return {"kv": "per row" if info.kv_per_row else "padded", "budget": info.kv_budget_tokens,
            "long_tokens": long.usage.prompt_tokens + long.usage.completion_tokens,
            "long_s": long_ended - long_started, **_summary("alone", alone), **_summary("beside", beside)}


def _summary(name: str, seconds: list[float]) -> dict:
    if not seconds:
        return {f"{name}_n": 0}
    return {f"{name}_n": len(seconds), f"{name}_p50_s": statistics.median(seconds),
            f"{name}_p90_s": seconds[int(len(seconds) * 0.9)], f"{name}_max_s": seconds[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--long-prompt-tokens", type=int, default=7900)
    parser.add_argument("--long-max-tokens", type=int, default=290)
    parser.add_argument("--alone-s", type=float, default=10.0, help="seconds of short requests before the long one")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    result = measure(EngineConfig(), args.clients, args.long_prompt_tokens, args.long_max_tokens, args.alone_s)
    columns = list(result)
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in result.values()) + " |")


if __name__ == "__main__":
    main()

"""How much a long prompt stalls the streams already running.

    python -m bench.experiments.long_prompt [--prompt-chars 30000] [--streams 2] [--dtype bfloat16]

Streams keep decoding (each restarts when it finishes) while one long prompt is admitted and
prefilled; the table gives the streams' inter-token gaps during that prefill, and the long
prompt's own time to first token, for chunked prefill as configured and, for comparison,
with chunks so large that the prompt goes in one piece.
"""
import argparse
import logging
import statistics
import threading
import time

from engine import EngineConfig, LLMEngine, SamplingParams

logger = logging.getLogger(__name__)


def measure(config: EngineConfig, prompt_chars: int, num_streams: int) -> dict:
    engine = LLMEngine(config).start()
    gaps, is_done = [], threading.Event()

    def stream(index: int) -> None:
        while not is_done.is_set():
            last = None
            handle = engine.submit(f"Count slowly from {index}:", SamplingParams(max_tokens=200, ignore_eos=True))
            for _ in handle:
                now = time.monotonic()
                if last is not None:
                    gaps.append((now - last, now))
                last = now

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(num_streams)]
    for thread in threads:
        thread.start()
    try:
        is_done.wait(2.0)  # let the streams settle into decoding
        started = time.monotonic()
        output = engine.submit("x" * prompt_chars, SamplingParams(max_tokens=1)).result()
        finished = time.monotonic()
    finally:
        is_done.set()
        for thread in threads:
            thread.join(120)
        engine.shutdown()
    during = sorted(gap for gap, at in gaps if started <= at <= finished + 0.5)
    return {"prompt_tokens": output.usage.prompt_tokens, "finish": output.finish_reason.value,
            "long_prompt_s": finished - started, "stream_tokens": len(during),
            "median_gap_s": statistics.median(during) if during else None,
            "p99_gap_s": during[int(len(during) * 0.99)] if during else None,
            "max_gap_s": during[-1] if during else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-chars", type=int, default=30000, help='the long prompt is "x" * this')
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backend", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--no-baseline", action="store_true", help="skip the one-piece prefill run")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    runs = [(f"{args.backend}: chunked (defaults)", EngineConfig(dtype=args.dtype, backend=args.backend))]
    if not args.no_baseline and args.backend == "hf":
        # One piece: as before chunking, the whole prompt in a single forward inside one step.
        runs.append(("hf: one piece", EngineConfig(dtype=args.dtype, prefill_chunk_tokens=1 << 20,
                                               prefill_step_target_s=1e6)))
    print("| prefill | prompt tokens | long prompt s | stream tokens meanwhile | median gap s | p99 gap s | "
          "max gap s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, config in runs:
        r = measure(config, args.prompt_chars, args.streams)
        print(f"| {name} | {r['prompt_tokens']} | {r['long_prompt_s']:.1f} | {r['stream_tokens']} | "
              f"{_fmt(r['median_gap_s'])} | {_fmt(r['p99_gap_s'])} | {_fmt(r['max_gap_s'])} |", flush=True)


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    main()

"""Serving benchmark: the same load against lockstep (WebSocket or REST) or any OpenAI-compatible server.

    python -m bench serve --url http://127.0.0.1:8000 [--api lockstep-ws|lockstep-rest|openai] [--model smollm2]
        [--dataset builtin|random] [--input-len 32] [--output-len 128] [--range-ratio 0] [--num-requests N]
        [--request-rate inf] [--burstiness 1] [--max-concurrency 1,8,16] [--ignore-eos/--no-ignore-eos]
        [--eos-method field|logit-bias|none] [--goodput ttft:100 tpot:50] [--result-json F] [--plot F.png]
        [--probe [--probe-streams 8] [--probe-count 15]]

Requests arrive as a Poisson process at --request-rate (inf: all at once), at most --max-concurrency in flight
(a comma list runs one sweep point per value; without --num-requests each point sends 2 requests per slot). Each
point starts with a warm-up request that is not measured. The metrics are vLLM's (bench/serve_metrics.py); output
tokens are counted with the model's tokenizer on the text received. With --probe, after the sweep: the TTFT of a
~30-token prompt while --probe-streams long streams run (bench/probe.py; a streaming --api only).
"""
import argparse
import json
import logging
import math
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from . import probe, serve_data, serve_metrics
from .serve_client import EOS_METHODS, LockstepRest, LockstepWebSocket, OpenAiCompletions, RequestResult, Sampling

logger = logging.getLogger(__name__)

APIS = ("lockstep-ws", "lockstep-rest", "openai")
WARMUP_TOKENS = 8
DEFAULT_REQUESTS_PER_SLOT = 2
UNBOUNDED_DEFAULT_REQUESTS = 32


@dataclass(frozen=True)
class LoadShape:
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf: all at once
    burstiness: float = 1.0  # gamma shape of the gaps (1: Poisson), as vLLM's --burstiness
    max_concurrency: int | None = None  # requests in flight at most; None: no limit
    max_duration_s: float | None = None  # stop sending new requests after this long (bounds a sweep's time)
    deadline_s: float | None = None  # cut the requests still running this long after the start (they fail)
    seed: int = 0


@dataclass
class RunOutcome:
    specs: list[serve_data.RequestSpec]  # the requests sent (fewer than asked if max_duration_s cut the run)
    results: list[RequestResult]
    duration_s: float


def make_target(api: str, url: str, model: str | None = None, timeout_s: float = 600.0, api_key: str = ""):
    if api == "lockstep-ws":
        return LockstepWebSocket(url, timeout_s, api_key)
    if api == "lockstep-rest":
        return LockstepRest(url, timeout_s, api_key)
    if api == "openai":
        if not model:
            raise ValueError("--model is required for --api openai (the name the server serves)")
        return OpenAiCompletions(url, model, timeout_s, api_key)
    raise ValueError(f"unknown api {api!r}: use one of {', '.join(APIS)}")


def arrival_offsets(num_requests: int, shape: LoadShape) -> list[float]:
    """Seconds after the start at which each request is sent: gamma-distributed gaps (exponential for burstiness
    1), rescaled so the last arrival is at num_requests / rate, as vLLM does to steady throughput across seeds."""
    if math.isinf(shape.request_rate):
        return [0.0] * num_requests
    rng = random.Random(shape.seed)
    scale = 1.0 / (shape.request_rate * shape.burstiness)
    offsets, total = [], 0.0
    for _ in range(num_requests):
        total += rng.gammavariate(shape.burstiness, scale)
        offsets.append(total)
    factor = (num_requests / shape.request_rate) / offsets[-1] if offsets and offsets[-1] > 0 else 1.0
    return [offset * factor for offset in offsets]


def run_load(target, specs: list[serve_data.RequestSpec], sampling: Sampling, shape: LoadShape,
             show_progress: bool = True, label: str = "") -> RunOutcome:
    """Send `specs` by `shape` from a thread pool; return every sent request's result, in order. A request whose
    arrival comes while every slot is busy waits for one (in order), as in vLLM's benchmark; after
    `max_duration_s` no new request starts, and the ones in flight finish, unless they run past `deadline_s`: those
    are cut (their connections shut) and count as failed."""
    offsets = arrival_offsets(len(specs), shape)
    sent, futures = [], []
    workers = shape.max_concurrency or max(1, len(specs))
    slots = threading.BoundedSemaphore(workers)
    with tqdm(total=len(specs), desc=label or None, disable=not show_progress, leave=False) as progress, \
            ThreadPoolExecutor(workers, thread_name_prefix="bench-client") as pool:
        progress_lock = threading.Lock()

        def on_done(_future) -> None:
            slots.release()
            with progress_lock:
                progress.update(1)

        started = time.perf_counter()
        try:
            for spec, offset in zip(specs, offsets):
                if (delay := started + offset - time.perf_counter()) > 0:
                    time.sleep(delay)  # the arrival schedule itself: nothing to wait on but the clock
                if not slots.acquire(timeout=_time_left(started, shape.deadline_s)):
                    break
                if shape.max_duration_s is not None and time.perf_counter() - started > shape.max_duration_s:
                    slots.release()
                    break
                future = pool.submit(target.send, spec, sampling)
                future.add_done_callback(on_done)
                sent.append(spec)
                futures.append(future)
            cut_at = _wait_or_cut(target, futures, started, shape.deadline_s)
        except KeyboardInterrupt:
            target.abort()  # end the requests in flight, so the pool can shut down
            raise
        results = [future.result() for future in futures]
        duration = time.perf_counter() - started
    target.close()
    if cut_at is not None:
        _mark_cut(results, cut_at, shape.deadline_s)
    return RunOutcome(sent, results, duration)


def _time_left(started: float, deadline_s: float | None) -> float | None:
    return None if deadline_s is None else max(0.0, started + deadline_s - time.perf_counter())


def _wait_or_cut(target, futures: list, started: float, deadline_s: float | None) -> float | None:
    """Wait for every request; at the deadline, abort the ones still running and return when that was."""
    _, pending = wait(futures, timeout=_time_left(started, deadline_s))
    if not pending:
        return None
    cut_at = time.perf_counter()  # before the abort: the requests it ends stop their clocks right away
    target.abort()
    return cut_at


def _mark_cut(results: list[RequestResult], cut_at: float, deadline_s: float) -> None:
    for result in results:
        if not result.success and result.start_time + result.latency_s >= cut_at:
            result.error = f"cut: still running at the {deadline_s:g} s deadline ({result.error})"


def warm_up(target, sampling: Sampling) -> None:
    spec = serve_data.RequestSpec(-1, "Hello, my name is", 5, WARMUP_TOKENS)
    result = target.send(spec, sampling)
    target.close()
    if not result.success:
        logger.warning("the warm-up request failed: %s", result.error)


@dataclass
class Measurement:
    metrics: serve_metrics.RunMetrics
    outcome: RunOutcome
    output_tokens: list[int]  # per sent request, by the model's tokenizer (0 for a failed one)


def measure(target, specs, sampling: Sampling, shape: LoadShape, tokenizer, slos_ms: dict | None = None,
            show_progress: bool = True, label: str = "") -> Measurement:
    warm_up(target, sampling)
    outcome = run_load(target, specs, sampling, shape, show_progress, label)
    output_tokens = serve_metrics.output_token_counts(tokenizer, outcome.results)
    metrics = serve_metrics.calculate(outcome.specs, outcome.results, output_tokens, outcome.duration_s, slos_ms)
    failures = [r.error for r in outcome.results if not r.success]
    if failures:
        logger.warning("%s: %d request(s) failed, e.g. %s", label, len(failures), failures[0])
    return Measurement(metrics, outcome, output_tokens)


def requests_for(args, tokenizer, max_concurrency: int | None) -> list[serve_data.RequestSpec]:
    default = UNBOUNDED_DEFAULT_REQUESTS if max_concurrency is None else DEFAULT_REQUESTS_PER_SLOT * max_concurrency
    num_requests = args.num_requests or default
    if args.dataset == "random":
        return serve_data.random_requests(tokenizer, num_requests, args.input_len, args.output_len,
                                          args.range_ratio, args.seed)
    return serve_data.builtin_requests(tokenizer, num_requests, args.output_len, args.range_ratio, args.seed)


# -- reporting ---------------------------------------------------------------------------------------------------

TABLE_HEADER = ("| server | clients | rate | ok / failed | req/s | out tok/s | total tok/s | TTFT ms mean / p50 / p99 "
                "| TPOT ms mean / p50 / p99 | ITL ms mean / p50 / p99 | E2E ms mean / p50 / p99 | goodput req/s |\n"
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def table_row(label: str, max_concurrency: int | None, shape: LoadShape, m: serve_metrics.RunMetrics) -> str:
    clients = "-" if max_concurrency is None else str(max_concurrency)
    rate = "inf" if math.isinf(shape.request_rate) else f"{shape.request_rate:g}"
    goodput = "-" if m.request_goodput is None else f"{m.request_goodput:.2f}"
    return (f"| {label} | {clients} | {rate} | {m.completed} / {m.failed} | {m.request_throughput:.2f} | "
            f"{m.output_throughput:.1f} | {m.total_token_throughput:.1f} | {_triple(m.ttft)} | {_triple(m.tpot)} | "
            f"{_triple(m.itl)} | {_triple(m.e2el)} | {goodput} |")


def _triple(d: serve_metrics.Distribution | None) -> str:
    return "-" if d is None else f"{d.mean_ms:.0f} / {d.median_ms:.0f} / {d.p99_ms:.0f}"


def run_record(max_concurrency: int | None, shape: LoadShape, measurement: Measurement) -> dict:
    """One sweep point for the JSON file: its settings, its metrics and every request's own numbers."""
    requests = []
    outcome = measurement.outcome
    for spec, result, tokens in zip(outcome.specs, outcome.results, measurement.output_tokens):
        entry = {k: v for k, v in asdict(result).items() if k != "generated_text"}
        requests.append({**entry, "prompt_len": spec.prompt_len, "output_len": spec.output_len,
                         "output_tokens": tokens})
    return {"max_concurrency": max_concurrency, "request_rate": _json_number(shape.request_rate),
            "burstiness": shape.burstiness, "metrics": measurement.metrics.as_dict(), "requests": requests}


def _json_number(value: float):
    return "inf" if math.isinf(value) else value


def write_json(path: str, record: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1))


# -- command line ------------------------------------------------------------------------------------------------

def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", choices=("builtin", "random"), default="builtin")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens (random dataset)")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len * (1 +- ratio)")
    parser.add_argument("--num-requests", type=int, default=0, help="per sweep point (default: 2 per client)")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (Poisson), inf = burst")
    parser.add_argument("--burstiness", type=float, default=1.0)
    parser.add_argument("--max-duration", type=float, default=None, help="s per point before no new requests")
    parser.add_argument("--deadline", type=float, default=None,
                        help="s per point before the requests still running are cut (counted as failed)")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--goodput", nargs="*", metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="default: lockstep's prepared SmolLM2")
    parser.add_argument("--no-progress", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api", choices=APIS, default="lockstep-ws")
    parser.add_argument("--model", default=None, help="the served model name (--api openai)")
    parser.add_argument("--label", default=None, help="the server's name in the table and plot")
    parser.add_argument("--api-key", default=os.environ.get("LOCKSTEP_API_KEY", ""),
                        help="sent as a bearer token (default: $LOCKSTEP_API_KEY)")
    parser.add_argument("--max-concurrency", default="", help="comma list; empty = no limit")
    parser.add_argument("--eos-method", choices=EOS_METHODS, default="field",
                        help="field: ignore_eos in the body; logit-bias: ban the special tokens (llama.cpp)")
    parser.add_argument("--include-usage", action="store_true", help="ask an OpenAI server for its usage chunk")
    parser.add_argument("--result-json", default=None)
    parser.add_argument("--plot", default=None, help="PNG: throughput and TTFT against concurrency")
    parser.add_argument("--probe", action="store_true", help="after the sweep, the TTFT of a ~30-token prompt "
                                                             "beside --probe-streams running streams")
    parser.add_argument("--probe-streams", type=int, default=probe.ProbePlan.num_streams)
    parser.add_argument("--probe-count", type=int, default=probe.ProbePlan.num_probes)
    add_load_arguments(parser)
    return parser


def parse_concurrency(text: str) -> list[int | None]:
    if not text.strip():
        return [None]
    values = [int(v) for v in text.split(",")]
    if any(v < 1 for v in values):
        raise ValueError("--max-concurrency values must be at least 1")
    return values


def sampling_from(args, tokenizer, eos_method: str, include_usage: bool = False) -> Sampling:
    return Sampling(temperature=args.temperature, ignore_eos=args.ignore_eos, eos_method=eos_method,
                    banned_token_ids=tuple(sorted(tokenizer.all_special_ids)), include_usage=include_usage)


def check_load_arguments(args) -> None:
    if args.request_rate <= 0 or math.isnan(args.request_rate):
        raise ValueError("--request-rate must be positive (inf for a burst)")
    if not (0 < args.burstiness < math.inf):
        raise ValueError("--burstiness must be a positive number")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError("--temperature must be a finite number >= 0")
    if not 0 <= args.range_ratio < 1:
        raise ValueError("--range-ratio must be in [0, 1)")
    for name in ("max_duration", "deadline"):
        value = getattr(args, name)
        if value is not None and not 0 < value < math.inf:
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number of seconds")
    if args.output_len < 1 or args.input_len < 1 or args.num_requests < 0:
        raise ValueError("--output-len and --input-len must be at least 1, --num-requests at least 0")


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logger.setLevel(logging.INFO)
    try:
        check_load_arguments(args)
        if args.api == "openai" and not args.model:
            raise ValueError("--model is required for --api openai (the name the server serves)")
        probe_plan = probe_plan_from(args)
        concurrencies = parse_concurrency(args.max_concurrency)
        slos = serve_metrics.parse_slos(args.goodput)
    except ValueError as exc:
        parser.error(str(exc))
    tokenizer = serve_data.load_tokenizer(args.tokenizer)
    sampling = sampling_from(args, tokenizer, args.eos_method, args.include_usage)
    label = args.label or f"{args.api} {args.url}"
    rows, records, points = [], [], []
    for max_concurrency in concurrencies:
        shape = LoadShape(args.request_rate, args.burstiness, max_concurrency, args.max_duration, args.deadline,
                          args.seed)
        target = make_target(args.api, args.url, args.model, api_key=args.api_key)
        specs = requests_for(args, tokenizer, max_concurrency)
        measurement = measure(target, specs, sampling, shape, tokenizer, slos, not args.no_progress,
                              f"{label} x{max_concurrency or '-'}")
        rows.append(table_row(label, max_concurrency, shape, measurement.metrics))
        records.append(run_record(max_concurrency, shape, measurement))
        points.append((max_concurrency or len(measurement.outcome.specs), measurement.metrics))
        logger.info("%s", rows[-1])
    logger.info("\n%s\n%s", TABLE_HEADER, "\n".join(rows))
    probe_result = None
    if probe_plan is not None:
        probe_result = probe.measure(lambda: make_target(args.api, args.url, args.model, api_key=args.api_key),
                                     tokenizer, Sampling.greedy(tokenizer, args.eos_method), probe_plan)
        logger.info("%s", probe_result.line(label))
    if args.result_json:
        write_json(args.result_json, {"label": label, "api": args.api, "url": args.url, "args": _args_record(args),
                                      "runs": records, "probe": probe_result.as_dict() if probe_result else None})
    if args.plot:
        from .serve_plot import plot_sweeps

        plot_sweeps({label: points}, args.plot, f"{args.output_len} output tokens per request")


def probe_plan_from(args) -> probe.ProbePlan | None:
    if not args.probe:
        return None
    if args.api == "lockstep-rest":
        raise ValueError("--probe measures a first token: use a streaming --api (lockstep-ws or openai)")
    if args.probe_streams < 1 or args.probe_count < 1:
        raise ValueError("--probe-streams and --probe-count must be at least 1")
    return probe.ProbePlan(num_streams=args.probe_streams, num_probes=args.probe_count,
                           deadline_s=args.deadline or probe.ProbePlan.deadline_s)


def _args_record(args) -> dict:
    return {k: _json_number(v) if isinstance(v, float) else v for k, v in vars(args).items() if k != "api_key"}


if __name__ == "__main__":
    main()

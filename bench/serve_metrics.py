"""A run's numbers, with the definitions of vLLM's serving benchmark (vllm/benchmarks/serve.py, calculate_metrics),
so lockstep's figures compare with those published for vLLM:

- output tokens of a request: the model's tokenizer on the text received (no special tokens added), whatever the
  server reports (servers count differently: special tokens skipped in the text are not counted);
- request / output / total token throughput: completed requests, output tokens, prompt + output tokens, over the
  run's duration (first request sent to last answer received);
- TTFT: start to first piece of text; E2E: start to the end of the answer;
- TPOT per request: (E2E - TTFT) / (output tokens - 1), for requests with more than one output token;
- ITL: every gap between two consecutive pieces of text, pooled over all requests;
- goodput: completed requests per second whose TTFT, TPOT and E2E all meet the SLOs given (a request with one
  token has TPOT 0 there).
Non-streamed answers (lockstep REST) have no TTFT, TPOT or ITL: those stay None rather than a misleading 0.
"""
from dataclasses import asdict, dataclass

import numpy as np

from .serve_client import RequestResult
from .serve_data import RequestSpec, count_tokens

SLO_NAMES = ("ttft", "tpot", "e2el")  # vLLM's --goodput keys, values in ms


@dataclass(frozen=True)
class Distribution:
    mean_ms: float
    median_ms: float
    p99_ms: float
    std_ms: float

    @classmethod
    def of(cls, seconds: list[float]) -> "Distribution | None":
        if not seconds:
            return None
        values = np.asarray(seconds) * 1000
        return cls(float(values.mean()), float(np.median(values)), float(np.percentile(values, 99)),
                   float(values.std()))


@dataclass(frozen=True)
class RunMetrics:
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    ttft: Distribution | None
    tpot: Distribution | None
    itl: Distribution | None
    e2el: Distribution | None
    mean_output_tokens: float  # per completed request (with ignore_eos, compare with the output length asked)
    num_short_outputs: int  # completed requests that came back with fewer tokens than asked
    num_usage_mismatches: int  # completed requests whose server-reported token count differs from ours

    def as_dict(self) -> dict:
        return asdict(self)


def output_token_counts(tokenizer, results: list[RequestResult]) -> list[int]:
    return [count_tokens(tokenizer, r.generated_text) if r.success else 0 for r in results]


def calculate(specs: list[RequestSpec], results: list[RequestResult], output_tokens: list[int], duration_s: float,
              slos_ms: dict[str, float] | None = None) -> RunMetrics:
    """`results[i]` answers `specs[i]`; `output_tokens[i]` is its tokenizer count (see `output_token_counts`)."""
    done = [(s, r, n) for s, r, n in zip(specs, results, output_tokens) if r.success]
    streamed = [(s, r, n) for s, r, n in done if r.is_streaming and r.ttft_s is not None]
    tpots = [(r.latency_s - r.ttft_s) / (n - 1) for _, r, n in streamed if n > 1]
    total_output = sum(n for _, _, n in done)
    total_input = sum(s.prompt_len for s, _, _ in done)
    return RunMetrics(
        num_requests=len(results), completed=len(done), failed=len(results) - len(done), duration_s=duration_s,
        total_input_tokens=total_input, total_output_tokens=total_output,
        request_throughput=len(done) / duration_s, output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        request_goodput=_goodput(done, slos_ms, duration_s),
        ttft=Distribution.of([r.ttft_s for _, r, _ in streamed]), tpot=Distribution.of(tpots),
        itl=Distribution.of([gap for _, r, _ in streamed for gap in r.itl_s]),
        e2el=Distribution.of([r.latency_s for _, r, _ in done]),
        mean_output_tokens=total_output / len(done) if done else 0.0,
        num_short_outputs=sum(1 for s, _, n in done if n < s.output_len),
        num_usage_mismatches=sum(1 for _, r, n in done if r.server_output_tokens not in (None, n)))


def _goodput(done: list, slos_ms: dict[str, float] | None, duration_s: float) -> float | None:
    if not slos_ms:
        return None
    good = 0
    for _, result, num_tokens in done:
        measured_s = {"ttft": result.ttft_s if result.ttft_s is not None else result.latency_s,
                      "tpot": _tpot(result, num_tokens), "e2el": result.latency_s}
        good += all(measured_s[name] * 1000 <= limit for name, limit in slos_ms.items())
    return good / duration_s


def _tpot(result: RequestResult, num_tokens: int) -> float:
    if result.ttft_s is None or num_tokens <= 1:
        return 0.0
    return (result.latency_s - result.ttft_s) / (num_tokens - 1)


def parse_slos(items: list[str] | None) -> dict[str, float]:
    """`ttft:200 tpot:50` -> {"ttft": 200.0, "tpot": 50.0} (ms), as vLLM's --goodput takes them."""
    slos = {}
    for item in items or []:
        name, _, value = item.partition(":")
        if name not in SLO_NAMES:
            raise ValueError(f"unknown SLO {name!r}: use {', '.join(SLO_NAMES)}")
        limit = float(value)
        if not 0 < limit < float("inf"):
            raise ValueError(f"SLO {name} must be a positive number of ms, got {value!r}")
        slos[name] = limit
    return slos

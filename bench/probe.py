"""TTFT of a short prompt beside running streams, measured alike on lockstep (/ws) and on OpenAI-SSE servers.

It is the wait a new user feels on a busy server, which the sweep's TTFT (requests that start together) does not
show. Long streams run, each restarted as it ends; once all of them decode, short probes go out one after another,
and a probe counts only if every stream decoded throughout it. The run is bounded (`settle_timeout_s`,
`deadline_s`): a server that serves one request at a time never has the streams decode together, so its probes are
reported but not counted. The method and the results: the serving sections of docs/benchmarks.md.
"""
import logging
import math
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import numpy as np

from .serve_client import RequestResult, Sampling
from .serve_data import RequestSpec, builtin_requests, count_tokens

logger = logging.getLogger(__name__)

# ~30 tokens of SmolLM2's tokenizer (30-31 with the number); the number comes first so that no two probes share a
# cached prefix block on a server with prefix caching (vLLM). A sentence to continue, not a question: after a question
# the model's first greedy token is its end-of-turn token, which has no text, so every server's first text (what
# TTFT is timed by) came one decode step later (checked: numbers 1-30 all start with text now).
PROBE_PROMPT = ("Fact {n}: when you blow gently across the surface of a cup of hot tea, it cools down faster than "
                "when it just sits still, because")
PROBE_INDEX_BASE = 1_000_000  # probes' request ids, apart from the streams'
STREAM_RETRY_S = 0.5  # after a stream's request failed, before it is sent again
MAX_STREAM_FAILURES = 20  # then the streams give up (a server that refuses them)
STOP_JOIN_S = 30.0


@dataclass(frozen=True)
class ProbePlan:
    num_streams: int = 8
    stream_output_len: int = 512
    num_probes: int = 15
    probe_output_len: int = 8
    min_gap_s: float = 0.1  # between one probe's end and the next one's start, uniform in [min, max]
    max_gap_s: float = 0.5
    settle_timeout_s: float = 60.0  # for all the streams to be decoding (at most half the deadline: probes go out)
    deadline_s: float = 120.0  # for the whole run; a probe still running then is cut
    seed: int = 0


@dataclass(frozen=True)
class Probe:
    ttft_ms: float | None  # None: no text arrived
    e2e_ms: float
    num_streams_decoding: int  # streams decoding throughout the probe, start to end
    error: str = ""


@dataclass
class ProbeResult:
    plan: ProbePlan
    prompt_tokens: float  # mean tokens of the probes' prompts (model's tokenizer)
    probes: list[Probe] = field(default_factory=list)
    settled_s: float | None = None  # start until every stream was decoding; None: not within settle_timeout_s
    peak_streams_decoding: int = 0  # most streams decoding at once
    stream_failures: int = 0
    stream_error: str = ""  # the first stream failure

    @property
    def counted(self) -> list[Probe]:
        """The probes that completed while every stream was decoding: the measurement."""
        return [p for p in self.completed if p.num_streams_decoding == self.plan.num_streams]

    @property
    def completed(self) -> list[Probe]:
        return [p for p in self.probes if not p.error and p.ttft_ms is not None]

    def as_dict(self) -> dict:
        return {**asdict(self), "summary": self.summary()}

    @classmethod
    def from_dict(cls, values: dict) -> "ProbeResult":
        fields = {k: v for k, v in values.items() if k != "summary"}
        return cls(**{**fields, "plan": ProbePlan(**values["plan"]), "probes": [Probe(**p) for p in values["probes"]]})

    def summary(self) -> dict:
        """TTFT p50 / p90 / max and E2E p50 (ms) of the counted probes."""
        return {"counted": len(self.counted), "sent": len(self.probes), **percentiles(self.counted)}

    def line(self, label: str) -> str:
        s = self.summary()
        if not s["counted"]:
            return f"{label}: no probe beside {self.plan.num_streams} streams ({self.explain_uncounted()})"
        return (f"{label}: TTFT of a {self.prompt_tokens:.0f}-token prompt beside {self.plan.num_streams} streams, "
                f"{s['counted']} of {s['sent']} probes: p50 {s['ttft_p50_ms']:.0f} ms, p90 {s['ttft_p90_ms']:.0f} "
                f"ms, max {s['ttft_max_ms']:.0f} ms (E2E p50 {s['e2e_p50_ms']:.0f} ms)")

    def explain_uncounted(self) -> str:
        """Why no probe counts, with what was measured all the same."""
        reasons = []
        if self.settled_s is None:
            reasons.append(f"at most {self.peak_streams_decoding} of {self.plan.num_streams} streams decoded at once")
        if self.stream_failures:
            reasons.append(f"{self.stream_failures} stream request(s) failed, e.g. {self.stream_error[:120]}")
        if done := self.completed:
            reasons.append(f"TTFT of the {len(done)} probe(s) that completed anyway: p50 "
                           f"{percentiles(done)['ttft_p50_ms']:.0f} ms")
        if cut := [p for p in self.probes if p.error.startswith("cut")]:
            reasons.append(f"a probe {'with no text ' if cut[0].ttft_ms is None else ''}after "
                           f"{cut[0].e2e_ms / 1000:.0f} s was cut at the {self.plan.deadline_s:g} s deadline")
        return "; ".join(reasons) or "no probe was sent"


def percentiles(probes: list[Probe]) -> dict:
    if not probes:
        return {}
    ttfts = np.asarray([p.ttft_ms for p in probes])
    return {"ttft_p50_ms": float(np.median(ttfts)), "ttft_p90_ms": float(np.percentile(ttfts, 90)),
            "ttft_max_ms": float(ttfts.max()), "e2e_p50_ms": float(np.median([p.e2e_ms for p in probes]))}


def probe_requests(tokenizer, num_probes: int, output_len: int) -> list[RequestSpec]:
    prompts = [PROBE_PROMPT.format(n=i + 1) for i in range(num_probes)]
    return [RequestSpec(PROBE_INDEX_BASE + i, prompt, count_tokens(tokenizer, prompt), output_len)
            for i, prompt in enumerate(prompts)]


def measure_config(config, url: str, tokenizer, plan: ProbePlan) -> ProbeResult:
    """The probe against a server `bench compare` started (`config` is its peers.ServerConfig)."""
    from .peers import SERVED_NAME
    from .serve import make_target

    result = measure(lambda: make_target(config.api, url, SERVED_NAME), tokenizer,
                     Sampling.greedy(tokenizer, "field"), plan)
    logger.info("%s", result.line(config.name))
    return result


def measure(make_target: Callable[[], object], tokenizer, sampling: Sampling, plan: ProbePlan) -> ProbeResult:
    """Run the streams and the probes (see the module's text). `make_target()` gives a fresh client of a streaming
    protocol (serve.make_target): the streams and the probes each get their own."""
    started = time.perf_counter()
    stream_specs = builtin_requests(tokenizer, plan.num_streams, plan.stream_output_len)
    probe_specs = probe_requests(tokenizer, plan.num_probes, plan.probe_output_len)
    streams = _Streams(make_target(), stream_specs, sampling)
    streams.start()
    try:
        settle_timeout_s = min(plan.settle_timeout_s, plan.deadline_s / 2)
        settled = streams.wait_all_decoding(settle_timeout_s)
        settled_s = time.perf_counter() - started if settled else None
        if not settled:
            logger.warning("probe: the streams did not all decode within %.0f s (at most %d of %d at once); "
                           "probing anyway", settle_timeout_s, streams.peak_decoding, plan.num_streams)
        results = _send_probes(make_target(), probe_specs, sampling, plan, started)
    finally:
        streams.stop()
    probes = [Probe(None if r.ttft_s is None else r.ttft_s * 1000, r.latency_s * 1000,
                    streams.decoding_throughout(r.start_time, r.start_time + r.latency_s), r.error)
              for r in results]
    return ProbeResult(plan, float(np.mean([s.prompt_len for s in probe_specs])) if probe_specs else 0.0, probes,
                       settled_s, streams.peak_decoding, streams.failures, streams.first_error)


def _send_probes(target, specs: list[RequestSpec], sampling: Sampling, plan: ProbePlan,
                 started: float) -> list[RequestResult]:
    """One after another, a random gap between; the one still running at the deadline is cut (and no more sent)."""
    rng = random.Random(plan.seed)
    results = []
    with ThreadPoolExecutor(1, thread_name_prefix="bench-probe") as pool:
        for spec in specs:
            time_left = started + plan.deadline_s - time.perf_counter()
            if time_left <= 0:
                break
            future = pool.submit(target.send, spec, sampling)
            try:
                results.append(future.result(timeout=time_left))
            except TimeoutError:
                target.abort()
                result = future.result()
                result.error = f"cut: still running at the {plan.deadline_s:g} s deadline ({result.error})"
                results.append(result)
                break
            time.sleep(rng.uniform(plan.min_gap_s, plan.max_gap_s))  # the gap itself: nothing to wait on
    target.close()
    return results


class _Streams:
    """Streams kept running through `target` (one thread each, every request restarted as it ends), and when each
    was decoding: from its request's first text to its end."""

    def __init__(self, target, specs: list[RequestSpec], sampling: Sampling):
        self.target, self.specs, self.sampling = target, specs, sampling
        self._changed = threading.Condition()
        self._decoding_since: list[float | None] = [None] * len(specs)
        self._spans: list[tuple[int, float, float]] = []  # (stream, first text, end), ended requests
        self._stopping = threading.Event()
        self.peak_decoding = 0
        self.failures = 0
        self.first_error = ""
        self._threads = [threading.Thread(target=self._keep_running, args=(i,), name=f"bench-stream-{i}",
                                          daemon=True) for i in range(len(specs))]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def wait_all_decoding(self, timeout_s: float) -> bool:
        """True once every stream is decoding at the same time; False after `timeout_s` or when they gave up."""
        with self._changed:
            self._changed.wait_for(lambda: self._num_decoding() == len(self.specs) or self._stopping.is_set(),
                                   timeout_s)
            return self.peak_decoding == len(self.specs)

    def decoding_throughout(self, start: float, end: float) -> int:
        """How many streams were decoding for the whole of [start, end]."""
        with self._changed:
            spans = self._spans + [(i, since, math.inf) for i, since in enumerate(self._decoding_since)
                                   if since is not None]
        return len({i for i, first, last in spans if first <= start and end <= last})

    def stop(self) -> None:
        """Cancel every stream: shut their connections until no thread sends any more."""
        self._stopping.set()
        give_up_at = time.monotonic() + STOP_JOIN_S
        for thread in self._threads:
            while thread.is_alive() and time.monotonic() < give_up_at:
                self.target.abort()  # again each time: a thread may have opened a new connection meanwhile
                thread.join(0.5)
        self.target.close()

    def _keep_running(self, stream: int) -> None:
        while not self._stopping.is_set():
            result = self.target.send(self.specs[stream], self.sampling, lambda: self._began(stream))
            self._ended(stream)
            if not result.success and not self._stopping.is_set():
                self._failed(result.error)
                self._stopping.wait(STREAM_RETRY_S)

    def _began(self, stream: int) -> None:
        with self._changed:
            self._decoding_since[stream] = time.perf_counter()
            self.peak_decoding = max(self.peak_decoding, self._num_decoding())
            self._changed.notify_all()

    def _ended(self, stream: int) -> None:
        with self._changed:
            since, self._decoding_since[stream] = self._decoding_since[stream], None
            if since is not None:
                self._spans.append((stream, since, time.perf_counter()))

    def _failed(self, error: str) -> None:
        with self._changed:
            self.failures += 1
            self.first_error = self.first_error or error
            if self.failures >= MAX_STREAM_FAILURES:
                logger.warning("probe: %d stream requests failed, e.g. %s; the streams give up", self.failures,
                               self.first_error)
                self._stopping.set()
                self._changed.notify_all()

    def _num_decoding(self) -> int:
        return sum(since is not None for since in self._decoding_since)

"""Prometheus metrics with vLLM's names under a `lockstep:` prefix, fed by the engine's observer hooks."""


from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from engine import RequestObserver

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ServerMetrics(RequestObserver):
    """One registry per app (no global state), so several apps in one process do not collide."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram("lockstep:time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token = Histogram("lockstep:inter_token_latency_seconds", "Time between output tokens.",
                                     buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("lockstep:e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("lockstep:request_queue_time_seconds", "Time spent waiting in the queue.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("lockstep:prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("lockstep:generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("lockstep:request_success", "Finished requests by finish reason.",
                                ["finished_reason"], registry=r)
        self.running = Gauge("lockstep:num_requests_running", "Requests in the running batch.", registry=r)
        self.waiting = Gauge("lockstep:num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.worker_restarts = Counter("lockstep:worker_restarts", "Model workers forked to replace one that "
                                       "died, hung or answered wrong.", registry=r)
        self.ready = Gauge("lockstep:worker_ready", "1 when the model worker is up.", registry=r)
        # vLLM's names: prompt tokens looked up in the prefix cache, and of them those found there.
        self.prefix_queries = Counter("lockstep:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache.", registry=r)
        self.prefix_hits = Counter("lockstep:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   registry=r)
        self._prefix_cache_on = lambda: False

    def bind(self, engine) -> None:
        self.running.set_function(lambda: engine.num_running)
        self.waiting.set_function(lambda: engine.num_waiting)
        self.ready.set_function(lambda: 1.0 if engine.is_ready else 0.0)
        self._prefix_cache_on = lambda: engine.info is not None and engine.info.prefix_cache

    def on_token(self, seq, now: float, previous: float | None) -> None:
        if previous is None:
            self.ttft.observe(now - seq.arrival_time)
        else:
            self.inter_token.observe(now - previous)

    def on_finish(self, seq, output) -> None:
        self.requests.labels(output.finish_reason.value).inc()
        self.generation_tokens.inc(output.usage.completion_tokens)
        self.e2e.observe(output.timings.e2e_s)
        if seq.scheduled_time is None:  # cancelled or expired while it waited: the model never read its prompt
            return
        self.queue_time.observe(seq.scheduled_time - seq.arrival_time)
        self.prompt_tokens.inc(output.usage.prompt_tokens)
        if self._prefix_cache_on() and seq.sampling.prompt_logprobs is None:  # echo computes every position
            self.prefix_queries.inc(output.usage.prompt_tokens)
            self.prefix_hits.inc(output.usage.cached_tokens)

    def on_worker_restart(self) -> None:
        self.worker_restarts.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)



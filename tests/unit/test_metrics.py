"""The Prometheus counters count what the model read: not the prompts of requests that never left the queue."""
from app.ops.metrics import ServerMetrics
from engine import FinishReason, RequestOutput, Usage
from engine.messages import WorkerSampling
from engine.outputs import Timings
from engine.sequence import Sequence


def _finish(metrics: ServerMetrics, scheduled: bool, echo: bool = False) -> None:
    seq = Sequence("r", [1] * 100, WorkerSampling(prompt_logprobs=0 if echo else None))
    seq.scheduled_time = seq.arrival_time + 0.5 if scheduled else None
    reason = FinishReason.LENGTH if scheduled else FinishReason.ABORT
    cached = 64 if scheduled and not echo else 0
    output = RequestOutput("r", "", reason, Usage(100, 0, cached), Timings(0.5, None, 1.0, 0.0))
    metrics.on_finish(seq, output)


def _value(metrics: ServerMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name) or 0.0


def test_prompts_that_were_never_read_count_nowhere_and_echo_skips_the_cache():
    metrics = ServerMetrics()
    metrics._prefix_cache_on = lambda: True
    _finish(metrics, scheduled=False)  # cancelled (or past its deadline) while it waited
    assert _value(metrics, "lockstep:prompt_tokens_total") == 0
    assert _value(metrics, "lockstep:prefix_cache_queries_total") == 0
    assert metrics.registry.get_sample_value("lockstep:request_success_total", {"finished_reason": "abort"}) == 1
    _finish(metrics, scheduled=True)
    _finish(metrics, scheduled=True, echo=True)  # every prompt position computed: not a cache lookup
    assert _value(metrics, "lockstep:prompt_tokens_total") == 200
    assert _value(metrics, "lockstep:prefix_cache_queries_total") == 100
    assert _value(metrics, "lockstep:prefix_cache_hits_total") == 64
    assert _value(metrics, "lockstep:request_queue_time_seconds_count") == 2

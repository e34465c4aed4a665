"""SampleGroup: the sink that a request's samples (n > 1, best_of) share.

It relays their deltas (with the sample's index) as they come and, once every sample has finished,
puts one RequestOutput into the request's own sink, whose `samples` are the n returned (best first
for best_of). A sample that fails fails the request and stops its siblings.
"""
import dataclasses
import queue
import threading

from .messages import FinishReason
from .outputs import DeltaEvent, RequestOutput, Usage
from .sequence import Sequence


class SampleGroup:
    """Thread-safe: a waiting sample cancelled by its own id finishes on the caller's thread while its siblings
    finish on the scheduler thread."""

    def __init__(self, request_id: str, n: int, sink: "queue.Queue", sequences: list[Sequence] | None = None):
        self.request_id = request_id
        self.n = n
        self.sink = sink
        self.sequences: list[Sequence] = sequences or []
        self.outputs: list[RequestOutput] = []
        self.is_failed = False
        self._lock = threading.Lock()

    def put(self, event) -> None:
        with self._lock:
            if isinstance(event, DeltaEvent):
                if not self.is_failed:
                    self.sink.put(event)
                return
            self.outputs.append(event)
            if event.finish_reason is FinishReason.ERROR and not self.is_failed:
                self.is_failed = True
                for seq in self.sequences:
                    seq.is_abort_requested = True
            if len(self.outputs) == len(self.sequences):
                self.sink.put(self._combined())

    def _combined(self) -> RequestOutput:
        failed = next((o for o in self.outputs if o.finish_reason is FinishReason.ERROR), None)
        if failed is not None:
            return dataclasses.replace(failed, request_id=self.request_id)
        ranked = sorted(self.outputs, key=lambda o: o.index)
        if len(ranked) > self.n:  # best_of: the highest cumulative logprob first, as OpenAI and vLLM
            ranked = sorted(ranked, key=lambda o: o.cumulative_logprob, reverse=True)[:self.n]
        samples = tuple(dataclasses.replace(o, request_id=self.request_id, index=i) for i, o in enumerate(ranked))
        best = samples[0]
        usage = Usage(best.usage.prompt_tokens, sum(o.usage.completion_tokens for o in self.outputs),
                      best.usage.cached_tokens)
        return dataclasses.replace(best, usage=usage, samples=samples)

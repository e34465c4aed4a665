"""A request's life in the parent: its token ids, detokenizer, timings and the sink its events go to.

A request with n > 1 (or best_of) is a group of Sequences, one per sample, that share one sink, a
SampleGroup: it relays their deltas (with the sample's index) and, once every sample has finished,
delivers one RequestOutput whose `samples` are the n returned.
"""
import dataclasses
import queue
import time
from dataclasses import dataclass, field
from enum import Enum, auto

from .detokenizer import IncrementalDetokenizer
from .messages import FinishReason, NewRequest, TokenLogprob, WorkerSampling


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose keys and values came from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}


@dataclass(frozen=True)
class Timings:
    queue_s: float
    ttft_s: float | None
    e2e_s: float
    tokens_per_s: float

    def as_dict(self) -> dict:
        return {"queue_ms": round(self.queue_s * 1000, 2),
                "ttft_ms": None if self.ttft_s is None else round(self.ttft_s * 1000, 2),
                "e2e_ms": round(self.e2e_s * 1000, 2),
                "tokens_per_s": round(self.tokens_per_s, 2)}


@dataclass(frozen=True)
class DeltaEvent:
    request_id: str
    text: str
    index: int = 0  # which sample (n > 1)
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens since the last delta (when the worker sent them)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    output_token_ids: tuple[int, ...] = ()
    error: str | None = None
    error_code: str | None = None
    prompt_token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per output token, when the worker sent them
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # echo: one per prompt token, the first None
    index: int = 0
    samples: tuple["RequestOutput", ...] = ()  # n > 1: the samples returned, best first for best_of
    cumulative_logprob: float = 0.0  # of every generated token, EOS included (best_of ranks by it)

    @property
    def choices(self) -> tuple["RequestOutput", ...]:
        """Every sample returned (one for n == 1)."""
        return self.samples or (self,)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: WorkerSampling
    detokenizer: IncrementalDetokenizer
    sink: "queue.Queue"
    eos_token_ids: frozenset[int] = frozenset()
    client_id: str = ""  # who asked: admission is fair across clients
    deadline: float = float("inf")  # time.monotonic() past which the request fails with deadline_exceeded
    group_id: str = ""  # n > 1: the request's id, shared by its samples ("" = request_id)
    sample_index: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    is_abort_requested: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    cache_salt: str | None = None
    cached_tokens: int = 0  # the worker's report: prompt tokens it did not prefill (prefix cache)
    _unsent_logprobs: list[TokenLogprob] = field(default_factory=list)  # not yet in a delta

    def __post_init__(self):
        self.group_id = self.group_id or self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """Prompt plus the most it may generate: what its KV cache can grow to."""
        return self.num_prompt_tokens + self.sampling.max_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def to_new_request(self, sample_ids: tuple[str, ...] = ()) -> NewRequest:
        """The worker's copy; a group's first sample carries every sample id (one prefill for all)."""
        if sample_ids:
            return NewRequest(self.group_id, tuple(self.prompt_token_ids), self.sampling, sample_ids,
                              self.cache_salt)
        return NewRequest(self.request_id, tuple(self.prompt_token_ids), self.sampling, cache_salt=self.cache_salt)

    def append_token(self, token_id: int, now: float, logprob: TokenLogprob | None = None) -> FinishReason | None:
        """Record one token, stream its text, and say whether the request is now finished."""
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.cumulative_logprob += logprob.logprob
        if token_id in self.eos_token_ids:  # no text shows it, so neither do the logprobs (as OpenAI's)
            return FinishReason.STOP
        if logprob is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.append(logprob)
            self._unsent_logprobs.append(logprob)
        self._emit(self.detokenizer.add_token(token_id))
        if self.detokenizer.stopped_by is not None:
            return FinishReason.STOP
        if self.num_output_tokens >= self.sampling.max_tokens:
            return FinishReason.LENGTH
        return None

    def finish(self, reason: FinishReason, error: Exception | None = None) -> RequestOutput:
        self.status = SequenceStatus.FINISHED
        if reason is not FinishReason.ERROR:
            self._emit(self.detokenizer.flush())
        output = RequestOutput(
            request_id=self.request_id,
            text=self.detokenizer.text[:self.detokenizer.num_released],
            finish_reason=reason,
            usage=Usage(self.num_prompt_tokens, self.num_output_tokens, self.cached_tokens),
            timings=self._timings(time.monotonic()),
            output_token_ids=tuple(self.output_token_ids),
            error=None if error is None else str(error),
            error_code=None if error is None else getattr(error, "code", "internal_error"),
            prompt_token_ids=tuple(self.prompt_token_ids),
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
            prompt_logprobs=self.prompt_logprobs,
            index=self.sample_index,
            cumulative_logprob=self.cumulative_logprob,
        )
        if reason is not FinishReason.ERROR and self._unsent_logprobs:  # an EOS token's entry has no text
            self._emit("", force=True)
        self.sink.put(output)
        return output

    def _emit(self, text: str, force: bool = False) -> None:
        if text or force:
            self.sink.put(DeltaEvent(self.group_id, text, self.sample_index, tuple(self._unsent_logprobs)))
            self._unsent_logprobs.clear()

    def _timings(self, now: float) -> Timings:
        started = self.scheduled_time or now
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        decode_s = (self.last_token_time or now) - started
        rate = self.num_output_tokens / decode_s if decode_s > 0 else 0.0
        return Timings(queue_s=started - self.arrival_time, ttft_s=ttft,
                       e2e_s=now - self.arrival_time, tokens_per_s=rate)


class SampleGroup:
    """The sink of a request's samples (n > 1, best_of): relays their deltas as they come, and once all have
    finished puts one RequestOutput into the request's own sink. A sample that fails fails the request and
    stops its siblings (called under the scheduler's lock, as every sink is)."""

    def __init__(self, request_id: str, n: int, sink: "queue.Queue"):
        self.request_id = request_id
        self.n = n
        self.sink = sink
        self.sequences: list[Sequence] = []
        self.outputs: list[RequestOutput] = []
        self.is_failed = False

    def put(self, event) -> None:
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

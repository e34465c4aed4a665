"""A request's life in the parent: its token ids, detokenizer, timings and the sink its events go to."""
import queue
import time
from dataclasses import dataclass, field
from enum import Enum, auto

from .detokenizer import IncrementalDetokenizer
from .messages import FinishReason, NewRequest, WorkerSampling


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


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
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    is_abort_requested: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

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

    def to_new_request(self) -> NewRequest:
        return NewRequest(self.request_id, tuple(self.prompt_token_ids), self.sampling)

    def append_token(self, token_id: int, now: float) -> FinishReason | None:
        """Record one token, stream its text, and say whether the request is now finished."""
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now
        self.output_token_ids.append(token_id)
        if token_id in self.eos_token_ids:
            return FinishReason.STOP
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
            usage=Usage(self.num_prompt_tokens, self.num_output_tokens),
            timings=self._timings(time.monotonic()),
            output_token_ids=tuple(self.output_token_ids),
            error=None if error is None else str(error),
            error_code=None if error is None else getattr(error, "code", "internal_error"),
        )
        self.sink.put(output)
        return output

    def _emit(self, text: str) -> None:
        if text:
            self.sink.put(DeltaEvent(self.request_id, text))

    def _timings(self, now: float) -> Timings:
        started = self.scheduled_time or now
        ttft = None if self.first_token_time is None else self.first_token_time - self.arrival_time
        decode_s = (self.last_token_time or now) - started
        rate = self.num_output_tokens / decode_s if decode_s > 0 else 0.0
        return Timings(queue_s=started - self.arrival_time, ttft_s=ttft,
                       e2e_s=now - self.arrival_time, tokens_per_s=rate)

"""A sequence's state as the scheduler sees it: its token ids, sampling, status and timings.

Text (detokenizing, stop strings, logprobs, events) is the output side's: output_processor.py, which makes the
records of outputs.py. A request with n > 1 (or best_of) is a group of Sequences, one per sample, that share the
request's id as `group_id`.
"""
import time
from dataclasses import dataclass, field
from enum import Enum, auto

from .messages import NewRequest, WorkerSampling


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: WorkerSampling
    client_id: str = ""  # who asked: admission is fair across clients
    deadline: float = float("inf")  # time.monotonic() past which the request fails with deadline_exceeded
    group_id: str = ""  # n > 1: the request's id, shared by its samples ("" = request_id)
    sample_index: int = 0
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    is_abort_requested: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

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

    def append_token(self, token_id: int, now: float) -> None:
        self.first_token_time = self.first_token_time or now
        self.last_token_time = now
        self.output_token_ids.append(token_id)

    def to_new_request(self, sample_ids: tuple[str, ...] = ()) -> NewRequest:
        """The worker's copy; a group's first sample carries every sample id (one prefill for all)."""
        if sample_ids:
            return NewRequest(self.group_id, tuple(self.prompt_token_ids), self.sampling, sample_ids,
                              self.cache_salt)
        return NewRequest(self.request_id, tuple(self.prompt_token_ids), self.sampling, cache_salt=self.cache_salt)

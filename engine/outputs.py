"""What a request gives back: text deltas as they come (DeltaEvent), then one RequestOutput."""
from dataclasses import dataclass

from .messages import FinishReason, PromptLogprobs, TokenLogprob


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
    prompt_logprobs: PromptLogprobs | None = None  # echo: one per prompt token, the first None
    index: int = 0
    samples: tuple["RequestOutput", ...] = ()  # n > 1: the samples returned, best first for best_of
    cumulative_logprob: float = 0.0  # of every generated token, EOS included (best_of ranks by it)

    @property
    def choices(self) -> tuple["RequestOutput", ...]:
        """Every sample returned (one for n == 1)."""
        return self.samples or (self,)

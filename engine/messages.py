"""Every message that crosses the process boundary: frozen dataclasses of plain values.

The parent sends a request's prompt once (`NewRequest`); later steps send only which
requests finished so the worker frees their KV cache. The worker echoes each task's
`call_id` so the parent can prove that a result answers its own call.
"""
from array import array
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(frozen=True)
class WorkerSampling:
    """What the worker needs to pick a token; text-level settings (stop strings) stay in the parent."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False  # benchmarks: always generate max_tokens
    # Logits processors, in vLLM's order and semantics (see backends/sampler.py); the defaults change nothing.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()  # what min_tokens holds back (the parent's EOS set)
    # Log-probabilities: None = none; k = the sampled token's and the k most likely (top_logprobs).
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # echo: each prompt token's logprob (the first has none) and the top k
    json_schema: str | None = None  # JSON mode: the schema (JSON text) the output must match (backends/constrained.py)
    lark_grammar: str | None = None  # tool calls: the grammar (llguidance's Lark) of the calls (engine/tool_calls.py)

    @property
    def has_processors(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)


@dataclass(frozen=True)
class NewRequest:
    """A prompt to prefill once. With `sample_ids` (n > 1, best_of) every id is a sample of its own that
    forks from the shared prompt cache; without, `request_id` is the one sample."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: WorkerSampling
    sample_ids: tuple[str, ...] = ()
    cache_salt: str | None = None  # requests share cached prefixes only with requests of the same salt

    @property
    def all_sample_ids(self) -> tuple[str, ...]:
        return self.sample_ids or (self.request_id,)


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probability (of the model's raw distribution: see backends/sampler.py) and the
    `top` most likely (token id, logprob) pairs there, most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, eq=False)
class PromptLogprobs(Sequence[TokenLogprob | None]):
    """Echo's logprobs of a whole prompt, kept in columns: entry 0 is None (nothing predicts the first token), entry
    i the TokenLogprob of prompt token i. As TokenLogprob objects a 1,500-token prompt with 20 alternatives held
    ~4 MB in each process (16 such requests got the model worker OOM-killed in a 768 MB limit); in columns ~0.3 MB.
    Values are stored as float32: both backends compute logprobs in float32, so they come back as the same numbers.
    The worker fills it chunk by chunk (`add`) and sends it once the prompt is done; nothing changes it after."""

    token_ids: array = field(default_factory=lambda: array("i"))
    logprobs: array = field(default_factory=lambda: array("f"))
    top_ids: array = field(default_factory=lambda: array("i"))
    top_logprobs: array = field(default_factory=lambda: array("f"))
    top_ends: array = field(default_factory=lambda: array("i"))  # entry i's alternatives end at top_ends[i - 1]

    @classmethod
    def of(cls, entries: Iterable[TokenLogprob | None]) -> "PromptLogprobs":
        """From entries whose first is None (vLLM's prompt logprobs: vLLM computes them without its prefix cache, so
        only the first position lacks one; tests). Logprobs are rounded to float32."""
        columns = cls()
        for index, entry in enumerate(entries):
            if (entry is None) != (index == 0):
                raise ValueError("prompt logprobs: only the first entry is None")
            if entry is not None:
                columns.add([entry.token_id], [entry.logprob], [[i for i, _ in entry.top]], [[p for _, p in entry.top]])
        return columns

    def add(self, token_ids: Sequence[int], logprobs: Sequence[float], top_ids: Sequence[Sequence[int]],
            top_logprobs: Sequence[Sequence[float]]) -> None:
        """Entries for the next len(token_ids) prompt tokens, each with its alternatives, most likely first."""
        if not len(token_ids) == len(logprobs) == len(top_ids) == len(top_logprobs):
            raise ValueError("prompt logprobs: one logprob and one row of alternatives per token")
        self.token_ids.extend(token_ids)
        self.logprobs.extend(logprobs)
        for ids, values in zip(top_ids, top_logprobs):
            self.top_ids.extend(ids)
            self.top_logprobs.extend(values)
            self.top_ends.append(len(self.top_ids))

    def __eq__(self, other) -> bool:
        """Equal to another PromptLogprobs with the same columns, or to any sequence of the same entries."""
        if isinstance(other, PromptLogprobs):
            return (self.token_ids, self.logprobs, self.top_ids, self.top_logprobs, self.top_ends) == \
                (other.token_ids, other.logprobs, other.top_ids, other.top_logprobs, other.top_ends)
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # its columns grow while the worker fills it

    def __len__(self) -> int:
        return len(self.token_ids) + 1

    def __getitem__(self, index: int | slice) -> "TokenLogprob | None | list[TokenLogprob | None]":
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("prompt logprobs index out of range")
        return None if index == 0 else self._entry(index - 1)

    def __iter__(self) -> Iterator[TokenLogprob | None]:
        yield None
        for row in range(len(self.token_ids)):
            yield self._entry(row)

    def _entry(self, row: int) -> TokenLogprob:
        start, end = self.top_ends[row - 1] if row else 0, self.top_ends[row]
        return TokenLogprob(self.token_ids[row], self.logprobs[row],
                            tuple(zip(self.top_ids[start:end], self.top_logprobs[start:end])))


@dataclass(frozen=True)
class StepTask:
    """One scheduler step: free `finished_ids`, prefill `new_requests`, decode one token for the rest."""

    call_id: int
    new_requests: tuple[NewRequest, ...] = ()
    finished_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class EchoTask:
    """A no-op round-trip: readiness checks and the race tests use it."""

    call_id: int
    payload: str = ""


@dataclass(frozen=True)
class ShutdownTask:
    call_id: int = 0


def eos_ids(*values) -> tuple[int, ...]:
    """End-of-sequence ids from where models keep them (an id, a list of ids, or None), each once, sorted."""
    ids = set()
    for value in values:
        ids.update(value if isinstance(value, (list, tuple, set, frozenset)) else [] if value is None else [value])
    return tuple(sorted(ids))


@dataclass(frozen=True)
class ModelInfo:
    model: str
    backend: str
    dtype: str
    device: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    weights: str = ""  # the weights' format where it is not `dtype` (q4_1: the GGUF's 4-bit blocks)
    compute: str = ""  # what computes the model here (weights, kernels, threads)
    compute_reason: str = ""  # the host and why that was chosen
    prefix_cache: bool = False  # whether prompts resume from cached prefixes (hf: prefix_cache.py; vLLM: its own)
    kv_budget_tokens: int = 0  # positions of keys and values the batch may hold (0: the configured budget)
    kv_budget_reason: str = ""  # why the budget (and max_model_len) is less than configured: what memory leaves
    # How the batch holds keys and values: True, each row its own (the budget bounds the sum of the rows' prompt and
    # answer tokens); False, padded to the longest row (rows x the longest).
    kv_per_row: bool = False
    architecture: str = ""  # the model's family: the GGUF's architecture (llama, qwen2, ...) or the config's model_type
    weight_types: tuple[tuple[str, int], ...] = ()  # a GGUF's block types and how many tensors each, most first


@dataclass(frozen=True)
class WorkerReady:
    info: ModelInfo
    call_id: int = 0


@dataclass(frozen=True)
class StepOutput:
    """What a backend's step produced: new token ids per request (none for a request still in chunked
    prefill), and the requests it could not compute, with why (the worker dropped their state)."""

    new_token_ids: dict[str, tuple[int, ...]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    # Only for requests that asked: one entry per new token; the prompt's once, with its first token.
    logprobs: dict[str, tuple[TokenLogprob, ...]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Per sample of a request that started this step: prompt tokens found in the prefix cache, not prefilled.
    cached_tokens: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StepResult:
    call_id: int
    output: StepOutput = field(default_factory=StepOutput)


@dataclass(frozen=True)
class EchoResult:
    call_id: int
    payload: str = ""


@dataclass(frozen=True)
class WorkerFailure:
    call_id: int
    message: str


Task = StepTask | EchoTask | ShutdownTask
Result = WorkerReady | StepResult | EchoResult | WorkerFailure

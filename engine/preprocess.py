"""RequestPreprocessor: a submit's arguments -> a PreparedRequest, checked against the server's limits.

The input side of vLLM v1's split: everything that can refuse a request does so here, before it is
queued (InvalidRequest, PromptTooLong, Overloaded), so the scheduler only ever sees requests it can
run. The prompt is tokenized by the InputProcessor (inputs.py) after the cheap checks.
"""
import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from .config import EngineConfig
from .errors import InvalidRequest, PromptTooLong
from .inputs import InputProcessor, check_encodable
from .messages import ModelInfo, WorkerSampling, eos_ids
from .sampling import SamplingParams
from .sequence import Sequence

MAX_CACHE_SALT_CHARS = 1024


@dataclass(frozen=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams  # as the API gave them (stop strings, n)
    worker_sampling: WorkerSampling  # what the worker needs (max_tokens settled, the EOS set)
    deadline: float  # time.monotonic() past which it fails with deadline_exceeded
    eos_token_ids: frozenset[int]  # the tokens that end it (none with ignore_eos)
    client_id: str = ""
    cache_salt: str | None = None

    def sequences(self) -> list[Sequence]:
        """One per sample: a request with n > 1 (or best_of) is a group that shares its id."""
        if self.sampling.num_samples == 1:
            return [self._sequence(self.request_id)]
        return [self._sequence(f"{self.request_id}#{i}", i) for i in range(self.sampling.num_samples)]

    def _sequence(self, seq_id: str, index: int = 0) -> Sequence:
        return Sequence(seq_id, self.prompt_token_ids, self.worker_sampling, self.client_id, self.deadline,
                        group_id=self.request_id, sample_index=index, cache_salt=self.cache_salt)


class RequestPreprocessor:
    def __init__(self, config: EngineConfig, tokenizer, inputs: InputProcessor,
                 model_info: Callable[[], ModelInfo | None]):
        self.config = config
        self.tokenizer = tokenizer
        self.inputs = inputs
        self._model_info = model_info
        self._request_counter = itertools.count()

    @property
    def max_model_len(self) -> int:
        info = self._model_info()
        return info.max_model_len if info else 0

    def prepare(self, prompt: str | None, sampling: SamplingParams, messages: list[dict] | None = None,
                prompt_token_ids: list[int] | None = None, request_id: str | None = None, client_id: str = "",
                timeout_s: float | None = None, num_prompts: int = 1,
                cache_salt: str | None = None, tools: list[dict] | None = None,
                thinking: bool | None = None) -> PreparedRequest:
        self._validate(sampling)
        check_cache_salt(cache_salt)
        deadline = time.monotonic() + self._timeout(timeout_s)  # checked before the (costly) tokenization
        token_ids = self.inputs.process(prompt, messages, prompt_token_ids, tools, thinking)
        request_id = request_id or f"req-{next(self._request_counter)}-{uuid.uuid4().hex[:8]}"
        eos_token_ids = frozenset() if sampling.ignore_eos else self._eos_token_ids()
        max_tokens = self._max_tokens(sampling, len(token_ids))
        self._check_samples_fit_the_kv_budget(sampling, len(token_ids) + max_tokens)
        self._check_echo_size(sampling, len(token_ids) + max_tokens, num_prompts)
        worker_sampling = sampling.for_worker(max_tokens, tuple(sorted(eos_token_ids)))
        return PreparedRequest(request_id, token_ids, sampling, worker_sampling, deadline, eos_token_ids,
                               client_id, cache_salt)

    def _validate(self, sampling: SamplingParams) -> None:
        sampling.validate(self.config.max_stop_strings)
        sampling.check_vocabulary(len(self.tokenizer))
        limit = self.config.sample_limit
        if sampling.num_samples > limit:
            param = "best_of" if sampling.best_of else "n"
            raise InvalidRequest(f"{param} must be at most {limit} (LOCKSTEP_MAX_SAMPLES: a request's samples "
                                 "take that many batch slots at once)", param)

    def _check_samples_fit_the_kv_budget(self, sampling: SamplingParams, num_tokens: int) -> None:
        """A request's samples decode side by side, a slot each: together they must fit the worker's KV budget (a
        request alone always runs, so past the budget it would take memory a limit does not leave)."""
        info = self._model_info()
        budget = info.kv_budget_tokens if info else 0
        if budget and sampling.num_samples > 1 and sampling.num_samples * num_tokens > budget:
            param = "best_of" if sampling.best_of else "n"
            raise InvalidRequest(f"{sampling.num_samples} samples x {num_tokens} prompt and answer tokens is more "
                                 f"than the {budget} positions of keys and values this server holds "
                                 "(`max_batch_kv_tokens` in /v1/models): ask fewer samples or tokens", param)

    def _check_echo_size(self, sampling: SamplingParams, num_tokens: int, num_prompts: int) -> None:
        """echo with logprobs returns every prompt token's top logprobs in every sample: refuse a response past
        LOCKSTEP_MAX_ECHO_LOGPROB_ENTRIES (each prompt of a call gets an equal share)."""
        if not sampling.echo or sampling.logprobs is None:
            return
        entries = num_prompts * sampling.n * num_tokens * (sampling.logprobs + 1)
        if entries > self.config.max_echo_logprob_entries:
            raise InvalidRequest(
                f"echo with logprobs would return {entries} logprob entries ({num_prompts} prompts x {sampling.n} "
                f"choices x {num_tokens} prompt and answer tokens x {sampling.logprobs + 1}); at most "
                f"{self.config.max_echo_logprob_entries} (LOCKSTEP_MAX_ECHO_LOGPROB_ENTRIES): ask fewer logprobs, "
                "choices or tokens", "echo")

    def _max_tokens(self, sampling: SamplingParams, num_prompt_tokens: int) -> int:
        limit = self.max_model_len
        if sampling.max_tokens is not None and sampling.max_tokens > limit:
            raise InvalidRequest(f"max_tokens must be at most {limit} (the model's context length)", "max_tokens")
        room = limit - num_prompt_tokens
        if room < 1:
            raise PromptTooLong(f"the prompt has {num_prompt_tokens} tokens; this model's context is {limit} "
                                "tokens and at least one must be left to generate", "prompt")
        if sampling.max_tokens is None:
            return min(self.config.default_max_tokens, room)
        return min(max(sampling.max_tokens, 1), room)  # prompt only: the worker's pass over it ends in one token

    def _timeout(self, timeout_s: float | None) -> float:
        if timeout_s is None:
            return self.config.request_timeout_s
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
            raise InvalidRequest("timeout must be a positive number of seconds", "timeout")
        return min(timeout_s, self.config.request_timeout_s)

    def _eos_token_ids(self) -> frozenset[int]:
        info = self._model_info()
        return frozenset(eos_ids(info.eos_token_ids if info else None, self.tokenizer.eos_token_id))


def check_samples_fit_a_client(num_prompts: int, sampling: SamplingParams, max_queue_per_client: int) -> None:
    """Every prompt's samples queue at once: more than a client may hold could never be queued (not a 429,
    which a client would retry forever)."""
    if num_prompts * sampling.num_samples > max_queue_per_client:
        param = ("best_of" if sampling.best_of else "n") if sampling.num_samples > 1 else "prompts"
        raise InvalidRequest(f"{num_prompts} prompts x {sampling.num_samples} samples is more than the "
                             f"{max_queue_per_client} sequences one client may queue (LOCKSTEP_MAX_QUEUE_PER_CLIENT); "
                             "send fewer prompts or samples", param)


def check_cache_salt(salt) -> None:
    if salt is None:
        return
    if not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
                             "cache_salt")
    check_encodable(salt, "cache_salt")  # the worker hashes its UTF-8 bytes

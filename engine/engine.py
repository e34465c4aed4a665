"""LLMEngine: the thread-safe public API. Submit from any thread; one scheduler thread drives the worker.

The step loop is three calls: schedule (admit and collect frees), run one round-trip on
the executor, postprocess (detokenize, stream, finish). A failed round-trip fails the
running requests with WorkerFailed and forks a fresh worker; waiting requests then run on it.
"""
import itertools
import logging
import queue
import threading
import time
import uuid

from .backends import choose_backend
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, TokenTexts
from .errors import EngineError, InvalidRequest, NotReady, PromptTooLong, WorkerFailed, describe
from .executor import ModelExecutor
from .inputs import InputProcessor
from .messages import ModelInfo, eos_ids
from .model_store import resolve_model
from .sampling import SamplingParams
from .scheduler import RequestObserver, Scheduler
from .sequence import DeltaEvent, RequestOutput, SampleGroup, Sequence

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = 1.0
EVENT_WAIT_S = 1.0  # how often a waiting caller checks that the scheduler thread still runs
READY_WINDOW_S = 10.0  # a round-trip answered this recently proves the worker alive without a probe


class RequestHandle:
    """What `submit` returns: iterate for text deltas, then `result()` for the RequestOutput."""

    def __init__(self, engine: "LLMEngine", request_id: str, events: queue.Queue):
        self.engine = engine
        self.request_id = request_id
        self._events = events
        self._output: RequestOutput | None = None

    def __iter__(self):
        """The text deltas (of every sample, for n > 1: `events()` says which)."""
        for event in self.events():
            yield event.text

    def events(self):
        """The DeltaEvents (text, sample index, logprobs) until the request finishes."""
        while self._output is None:
            event = self._next_event(EVENT_WAIT_S)
            if isinstance(event, DeltaEvent):
                yield event
            elif isinstance(event, RequestOutput):
                self._output = event

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the end of the request (deltas not yet read are skipped); queue.Empty after `timeout`."""
        deadline = time.monotonic() + (timeout if timeout is not None else float("inf"))
        while self._output is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise queue.Empty
            event = self._next_event(min(left, EVENT_WAIT_S))
            if isinstance(event, RequestOutput):
                self._output = event
        return self._output

    def _next_event(self, timeout: float):
        """The next event, or None after `timeout`; raises WorkerFailed if nothing can ever come."""
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            if not self.engine.is_scheduling:
                raise WorkerFailed("the engine's scheduler stopped") from None
            return None

    def cancel(self) -> bool:
        return self.engine.cancel(self.request_id)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, observer: RequestObserver | None = None):
        self.config = config or EngineConfig()
        self.scheduler = Scheduler(self.config.max_batch_size, self.config.max_queue, self.config.policy,
                                         observer, self.config.max_queue_per_client,
                                         self.config.max_batch_kv_tokens)
        self.tokenizer = None
        self.token_texts: TokenTexts | None = None
        self.inputs: InputProcessor | None = None
        self.executor: ModelExecutor | None = None
        self.info: ModelInfo | None = None
        self.backend_choice: tuple[str, str] | None = None
        self._first_start_done = threading.Event()
        self._stopping = threading.Event()
        self._accepting = True
        self._loop_thread: threading.Thread | None = None
        self._has_scheduler_died = False
        self._request_counter = itertools.count()
        self.load_error: str | None = None

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self, wait: bool = True) -> "LLMEngine":
        """Load the tokenizer, fork the worker and start the scheduler thread (model load waits if `wait`)."""
        from transformers import AutoTokenizer

        self.backend_choice = choose_backend(self.config)
        logger.info("backend %s (%s)", *self.backend_choice)
        model_path = resolve_model(self.config)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.token_texts = TokenTexts(self.tokenizer)
        self.inputs = InputProcessor(self.tokenizer, lambda: self.max_model_len)
        self.executor = ModelExecutor(self.config, model_path, self.backend_choice[0])
        self._loop_thread = threading.Thread(target=self._run_loop, name="lockstep-scheduler", daemon=True)
        self._loop_thread.start()
        if wait and not self._first_start_done.wait(self.config.load_timeout_s):
            raise NotReady("the model worker did not become ready in time")
        if wait and self.load_error:
            raise WorkerFailed(self.load_error)
        return self

    def stop_accepting(self) -> None:
        self._accepting = False

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop accepting, let running requests finish for up to `drain_timeout`, abort the rest, stop all."""
        self.stop_accepting()
        if drain_timeout > 0 and not self.scheduler.wait_idle(drain_timeout):
            logger.warning("shutdown: requests still running after %.0f s; aborting them", drain_timeout)
        self._stopping.set()
        self.scheduler.close()
        self.scheduler.fail_all(NotReady("the server is shutting down"))
        if self.executor:
            self.executor.shutdown()  # kills a worker stuck in a load or a step, which frees the loop thread
        if self._loop_thread:
            self._loop_thread.join(self.config.step_timeout_s)
        logger.info("engine stopped")

    @property
    def is_ready(self) -> bool:
        return self.executor is not None and self.executor.is_alive()

    @property
    def is_accepting(self) -> bool:
        return self._accepting

    @property
    def is_scheduling(self) -> bool:
        """The scheduler thread runs (or has not been started yet)."""
        return not self._has_scheduler_died and (self._loop_thread is None or self._loop_thread.is_alive())

    def readiness(self) -> tuple[bool, str]:
        """(ready, why): accepting requests, and the worker answered a round-trip recently or is busy with a
        step that is not yet overdue (a long step is work, not a hang)."""
        if not self._accepting:
            return False, "the server is draining"
        if not self.is_scheduling:
            return False, "the engine's scheduler stopped"
        if self.info is None or not self.is_ready:
            return False, self.load_error or "the model worker is loading or restarting"
        if self.executor.seconds_since_answer() < READY_WINDOW_S or self.executor.is_in_step_time():
            return True, "ready"
        return (True, "ready") if self.check_worker(wait=1.0) else (False, "the model worker does not answer")

    def check_worker(self, wait: float = 5.0) -> bool:
        """A real round-trip through the mutex: True only if the worker answers. Waits at most `wait` for a
        running step; only a worker that then fails to answer within the step timeout counts as hung."""
        if not self.is_ready:
            return False
        try:
            return self.executor.echo("ready?", lock_timeout=wait) == "ready?"
        except EngineError:
            return False

    # -- requests ----------------------------------------------------------------------------------------

    def submit(self, prompt: str | None = None, sampling: SamplingParams | None = None, *,
               messages: list[dict] | None = None, prompt_token_ids: list[int] | None = None,
               request_id: str | None = None, sink: queue.Queue | None = None, client_id: str = "",
               timeout_s: float | None = None, num_prompts: int = 1, cache_salt: str | None = None) -> RequestHandle:
        """Queue one request. Raises InvalidRequest, PromptTooLong, Overloaded or NotReady; never blocks.

        `client_id` groups requests for fair admission; `timeout_s` shortens the server's request deadline;
        `num_prompts` is how many prompts its call sent (each gets its share of the echo response budget);
        `cache_salt` (vLLM's field): only requests with the same salt share cached prompt prefixes."""
        if not self._accepting:
            raise NotReady("the server is shutting down")
        if not self.is_scheduling:
            raise NotReady("the engine's scheduler stopped")
        if self.info is None:  # after a crash requests wait for the new worker; before the first load they cannot
            raise NotReady(self.load_error or "the model is still loading; retry shortly")
        sampling = sampling or SamplingParams()
        self._validate(sampling)
        _check_cache_salt(cache_salt)
        deadline = time.monotonic() + self._timeout(timeout_s)  # checked before the (costly) tokenization
        token_ids = self.encode(prompt, messages, prompt_token_ids)
        request_id = request_id or f"req-{next(self._request_counter)}-{uuid.uuid4().hex[:8]}"
        sink = sink if sink is not None else queue.Queue()
        eos_token_ids = frozenset() if sampling.ignore_eos else self._eos_token_ids()
        max_tokens = self._max_tokens(sampling, len(token_ids))
        self._check_echo_size(sampling, len(token_ids) + max_tokens, num_prompts)
        worker_sampling = sampling.for_worker(max_tokens, tuple(sorted(eos_token_ids)))

        def sequence(seq_id: str, seq_sink, index: int = 0) -> Sequence:
            detokenizer = IncrementalDetokenizer(self.tokenizer, sampling.stop, worker_sampling.min_tokens)
            return Sequence(seq_id, token_ids, worker_sampling, detokenizer, seq_sink, eos_token_ids, client_id,
                            deadline, group_id=request_id, sample_index=index, cache_salt=cache_salt)

        if sampling.num_samples == 1:
            self.scheduler.add(sequence(request_id, sink))
        else:
            group = SampleGroup(request_id, sampling.n, sink)
            group.sequences = [sequence(f"{request_id}#{i}", group, i) for i in range(sampling.num_samples)]
            self.scheduler.add_group(group.sequences)
        return RequestHandle(self, request_id, sink)

    def _validate(self, sampling: SamplingParams) -> None:
        sampling.validate(self.config.max_stop_strings)
        sampling.check_vocabulary(len(self.tokenizer))
        limit = self.config.sample_limit
        if sampling.num_samples > limit:
            param = "best_of" if sampling.best_of else "n"
            raise InvalidRequest(f"{param} must be at most {limit} (LOCKSTEP_MAX_SAMPLES: a request's samples "
                                 "take that many batch slots at once)", param)

    def _check_samples_fit_a_client(self, num_prompts: int, sampling: SamplingParams) -> None:
        """Every prompt's samples queue at once: more than a client may hold could never be queued (not a 429,
        which a client would retry forever)."""
        limit = self.config.max_queue_per_client
        if num_prompts * sampling.num_samples > limit:
            param = ("best_of" if sampling.best_of else "n") if sampling.num_samples > 1 else "prompts"
            raise InvalidRequest(f"{num_prompts} prompts x {sampling.num_samples} samples is more than the "
                                 f"{limit} sequences one client may queue (LOCKSTEP_MAX_QUEUE_PER_CLIENT); "
                                 "send fewer prompts or samples", param)

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

    def submit_many(self, prompts: list[str], sampling: SamplingParams | None = None,
                    **options) -> list[RequestHandle]:
        """Submit every prompt (the scheduler batches them) or none: if one is refused, the others are cancelled.
        `options` are submit's keyword arguments (client_id, timeout_s)."""
        sampling = sampling or SamplingParams()
        self._check_samples_fit_a_client(len(prompts), sampling)
        handles = []
        try:
            for prompt in prompts:
                handles.append(self.submit(prompt, sampling, num_prompts=len(prompts), **options))
        except EngineError:
            for handle in handles:
                handle.cancel()
            raise
        return handles

    def generate(self, prompts: list[str], sampling: SamplingParams | None = None,
                 timeout: float | None = None) -> list[RequestOutput]:
        """Blocking helper: submit every prompt, return outputs in order."""
        return [handle.result(timeout) for handle in self.submit_many(prompts, sampling)]

    def cancel(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def wait_idle(self, timeout: float) -> bool:
        """Whether every request finished within `timeout` seconds (a drain waits on it)."""
        return self.scheduler.wait_idle(timeout)

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None,
               prompt_token_ids: list[int] | None = None) -> list[int]:
        """Validated prompt token ids (InvalidRequest, PromptTooLong or Overloaded otherwise)."""
        return self.inputs.process(prompt, messages, prompt_token_ids)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """The chat template's markers as special tokens, each message's content as plain text."""
        return self.inputs.encode_chat(messages)

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len if self.info else 0

    def _max_tokens(self, sampling: SamplingParams, num_prompt_tokens: int) -> int:
        limit = self.max_model_len
        if sampling.max_tokens is not None and sampling.max_tokens > limit:
            raise InvalidRequest(f"max_tokens must be at most {limit} (the model's context length)", "max_tokens")
        room = limit - num_prompt_tokens
        if room < 1:
            raise PromptTooLong(f"the prompt has {num_prompt_tokens} tokens; this model's context is {limit} "
                                "tokens and at least one must be left to generate", "prompt")
        return min(sampling.max_tokens or self.config.default_max_tokens, room)

    def _timeout(self, timeout_s: float | None) -> float:
        if timeout_s is None:
            return self.config.request_timeout_s
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
            raise InvalidRequest("timeout must be a positive number of seconds", "timeout")
        return min(timeout_s, self.config.request_timeout_s)

    def _eos_token_ids(self) -> frozenset[int]:
        return frozenset(eos_ids(self.info.eos_token_ids if self.info else None, self.tokenizer.eos_token_id))

    # -- the scheduler thread ------------------------------------------------------------------------------

    def _run_loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._run_once()
        except BaseException as exc:  # noqa: BLE001 - nothing may leave callers waiting on a dead thread
            logger.critical("the scheduler thread died: %r", exc, exc_info=exc)
            self._has_scheduler_died = True
            self.scheduler.close()
            self.scheduler.fail_all(WorkerFailed(f"the engine's scheduler stopped ({type(exc).__name__})"))
            self._first_start_done.set()

    def _run_once(self) -> None:
        try:
            if not self.executor.is_alive() and not self._start_worker():
                self._stopping.wait(RESTART_BACKOFF_S)
                return
            self._step()
        except EngineError as exc:
            self._on_worker_failure(exc)
        except Exception as exc:  # noqa: BLE001 - the loop must outlive a bug: fail, reset, go on
            logger.exception("scheduler step failed")
            self.executor.discard_worker()  # its KV cache no longer matches our bookkeeping
            self._on_worker_failure(WorkerFailed(f"internal error: {describe(exc)}"))

    def _step(self) -> None:
        plan = self.scheduler.schedule(timeout=1.0)
        if plan is not None:
            result = self.executor.step(plan.new_requests, plan.finished_ids)
            self.scheduler.postprocess(result.output)

    def _start_worker(self) -> bool:
        if self.info is not None:  # a restart: whatever the dead worker was computing is lost
            self.scheduler.fail_running(WorkerFailed("the model worker died between steps"))
            self.scheduler.observer.on_worker_restart()
        try:
            self.info = self.executor.start()
            self.load_error = None
            return True
        except EngineError as exc:
            self.load_error = str(exc)
            logger.error("model worker failed to start: %s", exc)
            if self.info is None:  # it never loaded: retrying a broken model would only loop
                self._stopping.set()
            self.scheduler.fail_all(exc)  # nobody should wait on a worker that cannot start
            return False
        finally:
            self._first_start_done.set()

    def _on_worker_failure(self, exc: EngineError) -> None:
        """The executor has already killed the worker; the loop forks a new one before the next step."""
        logger.error("model worker failed: %s; failing running requests and restarting it", exc)
        self.scheduler.fail_running(exc if isinstance(exc, WorkerFailed) else WorkerFailed(str(exc)))


MAX_CACHE_SALT_CHARS = 1024


def _check_cache_salt(salt) -> None:
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise InvalidRequest(f"cache_salt must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
                             "cache_salt")

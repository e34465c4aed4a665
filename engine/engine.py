"""LLMEngine: the thread-safe public API, a face over the engine's parts. Submit from any thread.

A request goes through the RequestPreprocessor (limits, tokens: a PreparedRequest), the EngineCore
(its scheduler thread drives the worker and restarts it) and the OutputProcessor (text, events, the
final output), as vLLM v1 splits them.
"""
import logging
import queue
import time

from .backend_choice import choose_backend
from .config import EngineConfig
from .detokenizer import TokenTexts
from .engine_core import EngineCore
from .errors import EngineError, NotReady, ShuttingDown, WorkerFailed
from .executor import ModelExecutor
from .inputs import InputProcessor
from .messages import ModelInfo
from .answer_stream import AnswerShape, opens_reasoning, template_has_reasoning
from .tool_calls import ToolFormat, ToolRequest, tool_format_for
from .model_store import resolve_model
from .output_processor import RequestObserver
from .outputs import DeltaEvent, RequestOutput
from .preprocess import RequestPreprocessor, check_samples_fit_a_client
from .sampling import SamplingParams
from .scheduler import Scheduler

logger = logging.getLogger(__name__)

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
                                   self.config.max_queue_per_client, self.config.max_batch_kv_tokens)
        self.core = EngineCore(self.scheduler, observer)
        self.tokenizer = None
        self.token_texts: TokenTexts | None = None
        self.inputs: InputProcessor | None = None
        self.preprocessor: RequestPreprocessor | None = None
        self.backend_choice: tuple[str, str] | None = None
        self._accepting = True
        self._opens_reasoning: dict[bool | None, bool] = {}  # thinking setting -> the template's prompt opens it

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
        self.preprocessor = RequestPreprocessor(self.config, self.tokenizer, self.inputs, lambda: self.info)
        self.core.outputs.tokenizer = self.tokenizer
        self.core.start(ModelExecutor(self.config, model_path, self.backend_choice[0]))
        if wait and not self.core.first_start_done.wait(self.config.load_timeout_s):
            raise NotReady("the model worker did not become ready in time")
        if wait and self.load_error:
            raise WorkerFailed(self.load_error)
        return self

    def stop_accepting(self) -> None:
        self._accepting = False

    def end_running(self) -> None:
        """Stop accepting and end every queued or running request with ShuttingDown (a drain past its timeout);
        the model worker stays up until `shutdown`, which may take a while."""
        self.stop_accepting()
        self.core.fail_all(ShuttingDown("the server is shutting down: the drain timeout passed"))

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop accepting, let running requests finish for up to `drain_timeout`, abort the rest, stop all."""
        self.stop_accepting()
        if drain_timeout > 0 and not self.scheduler.wait_idle(drain_timeout):
            logger.warning("shutdown: requests still running after %.0f s; aborting them", drain_timeout)
        self.core.stop(self.config.step_timeout_s)
        logger.info("engine stopped")

    @property
    def executor(self) -> ModelExecutor | None:
        return self.core.executor

    @property
    def info(self) -> ModelInfo | None:
        return self.core.info

    @property
    def load_error(self) -> str | None:
        return self.core.load_error

    @property
    def is_ready(self) -> bool:
        return self.executor is not None and self.executor.is_alive()

    @property
    def is_accepting(self) -> bool:
        return self._accepting

    @property
    def is_scheduling(self) -> bool:
        """The scheduler thread runs (or has not been started yet)."""
        return self.core.is_running

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
               timeout_s: float | None = None, num_prompts: int = 1, cache_salt: str | None = None,
               tools: list[dict] | None = None, thinking: bool | None = None) -> RequestHandle:
        """Queue one request. Raises InvalidRequest, PromptTooLong, Overloaded or NotReady; never blocks.

        `client_id` groups requests for fair admission; `timeout_s` shortens the server's request deadline;
        `num_prompts` is how many prompts its call sent (each gets its share of the echo response budget);
        `cache_salt` (vLLM's field): only requests with the same salt share cached prompt prefixes; `tools`
        (OpenAI's shape) go to a chat template that renders them (engine/tool_calls.py); `thinking` False turns a
        reasoning template's thinking off (its `enable_thinking`), None leaves the template's default."""
        if not self._accepting:
            raise ShuttingDown()
        if not self.is_scheduling:
            raise NotReady("the engine's scheduler stopped")
        if self.info is None:  # after a crash requests wait for the new worker; before the first load they cannot
            raise NotReady(self.load_error or "the model is still loading; retry shortly")
        prepared = self.preprocessor.prepare(prompt, sampling or SamplingParams(), messages, prompt_token_ids,
                                             request_id, client_id, timeout_s, num_prompts, cache_salt, tools,
                                             thinking)
        sink = sink if sink is not None else queue.Queue()
        self.core.add(prepared, sink)
        return RequestHandle(self, prepared.request_id, sink)

    def submit_many(self, prompts: list[str], sampling: SamplingParams | None = None,
                    **options) -> list[RequestHandle]:
        """Submit every prompt (the scheduler batches them) or none: if one is refused, the others are cancelled.
        `options` are submit's keyword arguments (client_id, timeout_s)."""
        sampling = sampling or SamplingParams()
        check_samples_fit_a_client(len(prompts), sampling, self.config.max_queue_per_client)
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
        return self.core.abort(request_id)

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

    @property
    def tool_format(self) -> ToolFormat:
        """How the model's chat template writes tool calls (engine/tool_calls.py)."""
        return tool_format_for(self.inputs.chat_template if self.inputs else None)

    def answer_shape(self, tools: ToolRequest | None = None, thinking: bool | None = None) -> AnswerShape:
        """What to take apart in the answer to a chat request (engine/answer_stream.py): the calls of the tools
        it offers, and the reasoning of a template with a `<think>` block unless the request turned thinking off."""
        template = self.inputs.chat_template if self.inputs else None
        has_reasoning = thinking is not False and template_has_reasoning(template)
        if has_reasoning and thinking not in self._opens_reasoning:
            self._opens_reasoning[thinking] = opens_reasoning(self.inputs.render, thinking)
        in_reasoning = has_reasoning and self._opens_reasoning[thinking]
        return AnswerShape(tools, self.tool_format, has_reasoning, in_reasoning)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """The chat template's markers as special tokens, each message's content as plain text."""
        return self.inputs.encode_chat(messages)

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len if self.info else 0

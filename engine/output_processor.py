"""OutputProcessor: a step's token ids -> each request's text deltas and, once it ends, its RequestOutput.

Per sequence a RequestState holds the incremental detokenizer (stop strings), the logprobs and the
sink its events go to, as vLLM v1 keeps one per request. The processor runs on the scheduler thread
outside the scheduler's lock, so `add` and `abort` never wait on detokenizing. Its own lock keeps one
writer per running request: a request's deltas come before its final output, and that output comes
once, from whoever the scheduler's status (changed under its lock) says finished it.
"""
import contextlib
import logging
import queue
import threading
import time

from .detokenizer import IncrementalDetokenizer
from .errors import RequestFailed
from .messages import FinishReason, PromptLogprobs, StepOutput, TokenLogprob
from .outputs import DeltaEvent, RequestOutput, Timings, Usage
from .preprocess import PreparedRequest
from .sample_group import SampleGroup
from .scheduler import Finished, Scheduler
from .sequence import Sequence

logger = logging.getLogger(__name__)


class RequestObserver:
    """Hooks for metrics; the default does nothing."""

    def on_token(self, seq: Sequence, now: float, previous: float | None) -> None:
        pass

    def on_finish(self, seq: Sequence, output) -> None:
        pass

    def on_worker_restart(self) -> None:
        pass


class RequestState:
    """One sequence's output side: its text so far, its logprobs, and where its events go."""

    def __init__(self, seq: Sequence, detokenizer: IncrementalDetokenizer, sink: "queue.Queue",
                 eos_token_ids: frozenset[int] = frozenset(), prompt_only: bool = False):
        self.seq = seq
        self.prompt_only = prompt_only  # echo with max_tokens 0: the token that ends the prompt's pass is dropped
        self.detokenizer = detokenizer
        self.sink = sink
        self.eos_token_ids = eos_token_ids
        self.logprobs: list[TokenLogprob] | None = None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: PromptLogprobs | None = None
        self.cached_tokens = 0  # the worker's report: prompt tokens it did not prefill (prefix cache)
        self._unsent_logprobs: list[TokenLogprob] = []  # not yet in a delta

    def record_step(self, output: StepOutput) -> None:
        """What the worker says once, at a request's first step."""
        request_id = self.seq.request_id
        if request_id in output.cached_tokens:
            self.cached_tokens = output.cached_tokens[request_id]
        if request_id in output.prompt_logprobs:
            self.prompt_logprobs = output.prompt_logprobs[request_id]

    def append_token(self, token_id: int, now: float, logprob: TokenLogprob | None = None) -> FinishReason | None:
        """Record one token, stream its text, and say whether the request is now finished."""
        self.seq.append_token(token_id, now)
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
        if self.seq.num_output_tokens >= self.seq.sampling.max_tokens:
            return FinishReason.LENGTH
        return None

    def final_output(self, reason: FinishReason, error: Exception | None = None) -> RequestOutput:
        """The last text (held back for stop strings), then the RequestOutput, into the sink."""
        seq = self.seq
        if reason is not FinishReason.ERROR:
            self._emit(self.detokenizer.flush())
        output = RequestOutput(
            request_id=seq.request_id,
            text=self.detokenizer.text[:self.detokenizer.num_released],
            finish_reason=reason,
            usage=Usage(seq.num_prompt_tokens, seq.num_output_tokens, self.cached_tokens),
            timings=self._timings(time.monotonic()),
            output_token_ids=tuple(seq.output_token_ids),
            error=None if error is None else str(error),
            error_code=None if error is None else getattr(error, "code", "internal_error"),
            prompt_token_ids=tuple(seq.prompt_token_ids),
            logprobs=None if self.logprobs is None else tuple(self.logprobs),
            prompt_logprobs=self.prompt_logprobs,
            index=seq.sample_index,
            cumulative_logprob=self.cumulative_logprob,
        )
        if reason is not FinishReason.ERROR and self._unsent_logprobs:  # an EOS token's entry has no text
            self._emit("", force=True)
        self.sink.put(output)
        return output

    def _emit(self, text: str, force: bool = False) -> None:
        if text or force:
            self.sink.put(DeltaEvent(self.seq.group_id, text, self.seq.sample_index, tuple(self._unsent_logprobs)))
            self._unsent_logprobs.clear()

    def _timings(self, now: float) -> Timings:
        seq = self.seq
        started = seq.scheduled_time or now
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        decode_s = (seq.last_token_time or now) - started
        rate = seq.num_output_tokens / decode_s if decode_s > 0 else 0.0
        return Timings(queue_s=started - seq.arrival_time, ttft_s=ttft,
                       e2e_s=now - seq.arrival_time, tokens_per_s=rate)


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, observer: RequestObserver | None = None, tokenizer=None):
        self.scheduler = scheduler
        self.observer = observer or RequestObserver()
        self.tokenizer = tokenizer  # set when the engine starts
        self._states: dict[Sequence, RequestState] = {}
        self._lock = threading.Lock()

    def new_states(self, prepared: PreparedRequest, sink: "queue.Queue") -> list[RequestState]:
        """One state per sample; a request's samples share a SampleGroup as their sink."""
        seqs = prepared.sequences()
        if len(seqs) > 1:
            sink = SampleGroup(prepared.request_id, prepared.sampling.n, sink, seqs)
        return [RequestState(seq, IncrementalDetokenizer(self.tokenizer, prepared.sampling.stop,
                                                         prepared.worker_sampling.min_tokens),
                             sink, prepared.eos_token_ids, prepared.sampling.is_prompt_only) for seq in seqs]

    def add(self, states: list[RequestState]) -> None:
        self._states.update((state.seq, state) for state in states)

    def discard(self, states: list[RequestState]) -> None:
        """The scheduler refused them: nothing will ever be delivered."""
        for state in states:
            self._states.pop(state.seq, None)

    def process(self, output: StepOutput) -> None:
        now = time.monotonic()
        with self._lock:
            for seq in self.scheduler.running_now():
                if not seq.is_finished:
                    self._process(self._states[seq], output, now)

    def finish(self, finished: list[Finished]) -> None:
        """The final outputs of sequences the scheduler took out. One that never ran has no text, so it needs
        no lock (a cancel never waits on a step's text)."""
        lock = self._lock if any(f.was_running for f in finished) else contextlib.nullcontext()
        with lock:
            for record in finished:
                self._deliver(record)

    def _process(self, state: RequestState, output: StepOutput, now: float) -> None:
        seq = state.seq
        if seq.request_id in output.failed:
            self._end(seq, FinishReason.ERROR, RequestFailed(
                f"the model could not compute this request ({output.failed[seq.request_id]})"))
            return
        try:
            state.record_step(output)
            reason = self._append_tokens(state, output.new_token_ids.get(seq.request_id, ()), now,
                                         output.logprobs.get(seq.request_id, ()))
            if reason is not None:
                self._end(seq, reason)
        except Exception as exc:  # noqa: BLE001 - one request's text handling fails it alone
            logger.exception("postprocessing %s failed", seq.request_id)
            self._end(seq, FinishReason.ERROR, RequestFailed(f"internal error: {type(exc).__name__}"))

    def _append_tokens(self, state: RequestState, token_ids: tuple[int, ...], now: float,
                       logprobs: tuple = ()) -> FinishReason | None:
        if state.prompt_only:  # no token to time either: it stays out of the TTFT histogram
            return FinishReason.LENGTH if token_ids else None
        for position, token_id in enumerate(token_ids):
            self.observer.on_token(state.seq, now, state.seq.last_token_time)
            reason = state.append_token(token_id, now, logprobs[position] if position < len(logprobs) else None)
            if reason is not None:
                return reason
        return None

    def _end(self, seq: Sequence, reason: FinishReason, error: Exception | None = None) -> None:
        """Under the lock: finish it unless it has finished already (it must not be finished twice)."""
        for record in self.scheduler.finish(seq, reason, error):
            self._deliver(record)

    def _deliver(self, record: Finished) -> None:
        seq = record.seq
        state = self._states.pop(seq)
        try:
            try:
                output = state.final_output(record.reason, record.error)
            except Exception as exc:  # noqa: BLE001 - its last text (flush) failed: it fails alone, its waiter hears
                logger.exception("finishing %s failed", seq.request_id)
                output = state.final_output(FinishReason.ERROR, RequestFailed(f"internal error: {type(exc).__name__}"))
            self.observer.on_finish(seq, output)
        finally:
            self.scheduler.release(seq)

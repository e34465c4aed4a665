"""Scheduler: the waiting queue, the running batch and the batching policy.

Request threads call `add` and `abort`; the one scheduler thread calls `schedule` (blocks
while there is nothing to do) and `postprocess`. One lock guards all of it.

Fairness: each client (an address) may hold at most `max_queue_per_client` waiting
requests, and slots go round-robin across clients (fewest running, then served longest
ago), so one client that keeps the queue full cannot lock the others out. Memory: the
worker's padded batch holds rows x longest row tokens; admission keeps that within
`max_batch_kv_tokens`. Deadlines: a request past its deadline fails with
deadline_exceeded, waiting or running. Samples: a request with n > 1 (or best_of) is a group of
sequences that is queued, admitted and sent to the worker as one (one prefill, forked there). A group that
does not fit yet does not hold up the requests behind it, until a batch's worth of sequences has gone past it:
then it reserves the slots as they free (it cannot be starved).
"""
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass

from .errors import DeadlineExceeded, EngineError, NotReady, Overloaded, RequestFailed
from .messages import FinishReason, NewRequest, StepOutput
from .sequence import Sequence, SequenceStatus

logger = logging.getLogger(__name__)

MAX_REMEMBERED_CLIENTS = 4096


@dataclass(frozen=True)
class StepPlan:
    new_requests: tuple[NewRequest, ...]
    finished_ids: tuple[str, ...]


class RequestObserver:
    """Hooks for metrics; the default does nothing."""

    def on_token(self, seq: Sequence, now: float, previous: float | None) -> None:
        pass

    def on_finish(self, seq: Sequence, output) -> None:
        pass

    def on_worker_restart(self) -> None:
        pass


class Scheduler:
    def __init__(self, max_batch_size: int = 8, max_queue: int = 64, policy: str = "continuous",
                 observer: RequestObserver | None = None, max_queue_per_client: int | None = None,
                 max_batch_kv_tokens: int | None = None):
        self.observer = observer or RequestObserver()
        self.max_batch_size = 1 if policy == "none" else max_batch_size
        self.max_queue = max_queue
        self.max_queue_per_client = max_queue_per_client or max_queue
        self.max_batch_kv_tokens = max_batch_kv_tokens or float("inf")
        self.policy = policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}
        self.finished_ids: list[str] = []  # the worker still holds their KV cache
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)
        self._is_idle = threading.Condition(self._lock)
        self._is_closed = False
        self._last_admitted: dict[str, float] = {}  # client id -> when it last got a slot
        self._passed: Counter[str] = Counter()  # waiting group id -> sequences admitted past it

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add(self, seq: Sequence) -> None:
        self.add_group([seq])

    def add_group(self, seqs: list[Sequence]) -> None:
        """Queue a request's sequences (its samples) all or none."""
        client_id = seqs[0].client_id
        with self._lock:
            if self._is_closed:
                raise NotReady("the server is shutting down")
            if len(self.waiting) + len(seqs) > self.max_queue:
                raise Overloaded(f"the queue is full ({self.max_queue} waiting requests); retry later")
            if sum(s.client_id == client_id for s in self.waiting) + len(seqs) > self.max_queue_per_client:
                raise Overloaded(f"this client already has {self.max_queue_per_client} waiting requests; "
                                 "wait for some to finish")
            for seq in seqs:
                if seq.request_id in self.sequences or seq.group_id in self.sequences:
                    raise ValueError(f"request id {seq.request_id!r} is already in use")
            self.waiting.extend(seqs)
            self.sequences.update((seq.request_id, seq) for seq in seqs)
            self._has_work.notify()

    def abort(self, request_id: str) -> bool:
        """Cancel a request (all its samples); a running one stops and frees its slot at the next step."""
        with self._lock:
            seqs = [self.sequences[request_id]] if request_id in self.sequences \
                else [s for s in self.sequences.values() if s.group_id == request_id]
            for seq in seqs:
                if seq.status is SequenceStatus.WAITING:
                    self.waiting.remove(seq)
                    self._finish(seq, FinishReason.ABORT)
                else:
                    seq.is_abort_requested = True
                    self._has_work.notify()
            return bool(seqs)

    def schedule(self, timeout: float | None = None) -> StepPlan | None:
        """Block until there is a step to run (or `timeout`/close); admit new requests by policy."""
        with self._lock:
            self._has_work.wait_for(lambda: self._is_closed or self._needs_step(), timeout)
            if self._is_closed:
                return None
            self._expire(time.monotonic())  # also on a timeout: a waiting request's deadline passes while idle
            if not self._needs_step():
                return None
            for seq in [s for s in self.running if s.is_abort_requested]:
                self._finish(seq, FinishReason.ABORT)
            admitted = self._admit()
            plan = StepPlan(_new_requests(admitted), tuple(self.finished_ids))
            self.finished_ids.clear()
            return plan

    def postprocess(self, output: StepOutput) -> None:
        now = time.monotonic()
        with self._lock:
            for seq in list(self.running):
                if seq.request_id in output.failed:
                    self._finish(seq, FinishReason.ERROR, RequestFailed(
                        f"the model could not compute this request ({output.failed[seq.request_id]})"))
                    continue
                try:
                    if seq.request_id in output.cached_tokens:
                        seq.cached_tokens = output.cached_tokens[seq.request_id]
                    if seq.request_id in output.prompt_logprobs:
                        seq.prompt_logprobs = output.prompt_logprobs[seq.request_id]
                    self._append_tokens(seq, output.new_token_ids.get(seq.request_id, ()), now,
                                        output.logprobs.get(seq.request_id, ()))
                except Exception as exc:  # noqa: BLE001 - one request's text handling fails it alone
                    logger.exception("postprocessing %s failed", seq.request_id)
                    if not seq.is_finished:  # finished already (a hook failed after): it must not be finished twice
                        self._finish(seq, FinishReason.ERROR, RequestFailed(f"internal error: {type(exc).__name__}"))

    def _append_tokens(self, seq: Sequence, token_ids: tuple[int, ...], now: float, logprobs: tuple = ()) -> None:
        for position, token_id in enumerate(token_ids):
            self.observer.on_token(seq, now, seq.last_token_time)
            reason = seq.append_token(token_id, now, logprobs[position] if position < len(logprobs) else None)
            if reason is not None:
                self._finish(seq, reason)
                return

    def fail_running(self, error: EngineError) -> None:
        """The worker is gone: fail what it was computing; waiting requests wait for the next worker."""
        with self._lock:
            for seq in list(self.running):
                self._finish(seq, FinishReason.ERROR, error)
            self.finished_ids.clear()

    def fail_all(self, error: EngineError) -> None:
        with self._lock:
            for seq in list(self.running) + list(self.waiting):
                self._finish(seq, FinishReason.ERROR, error)
            self.finished_ids.clear()

    def wait_idle(self, timeout: float) -> bool:
        with self._lock:
            return self._is_idle.wait_for(lambda: not self.sequences, timeout)

    def close(self) -> None:
        with self._lock:
            self._is_closed = True
            self._has_work.notify_all()

    def _needs_step(self) -> bool:
        return bool(self.running or self.finished_ids or (self.waiting and self._can_admit()))

    def _expire(self, now: float) -> None:
        for seq in [s for s in self.sequences.values() if s.deadline <= now]:
            if seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
            self._finish(seq, FinishReason.ERROR, DeadlineExceeded(
                f"the request did not finish within its deadline ({seq.num_output_tokens} tokens generated)"))

    def _can_admit(self) -> bool:
        if self.policy == "continuous":
            return len(self.running) < self.max_batch_size
        return not self.running  # static and none: the batch runs to completion first

    def _admit(self) -> list[Sequence]:
        if not self._can_admit():
            return []
        admitted, passed_groups = [], []
        now = time.monotonic()
        while len(self.running) < self.max_batch_size:
            seq = self._fairest_waiting(passed_groups, self._reserving_groups())
            if seq is None:
                break
            group = [s for s in self.waiting if s.group_id == seq.group_id]
            if not self._fits(group):
                if len(group) == 1 or self._passed[seq.group_id] >= self.max_batch_size:
                    break  # the batch drains until it fits: skipping to smaller requests could starve it
                passed_groups.append(seq.group_id)  # a group waits for slots; others may go past it, a while
                continue
            self._passed.pop(seq.group_id, None)
            self._passed.update({group_id: len(group) for group_id in passed_groups})
            self._remember_admission(seq.client_id)
            for member in group:
                self.waiting.remove(member)
                member.status, member.scheduled_time = SequenceStatus.RUNNING, now
            self.running.extend(group)
            admitted.extend(group)
        return admitted

    def _fits(self, group: list[Sequence]) -> bool:
        """Room for all of a request's samples at once (a group larger than the batch runs alone)."""
        if not self.running:
            return True
        return len(self.running) + len(group) <= self.max_batch_size and self._fits_kv_budget(group)

    def _reserving_groups(self) -> set[str]:
        """Waiting groups that a batch's worth of sequences went past: the slots that free are theirs."""
        return {group_id for group_id, count in self._passed.items() if count >= self.max_batch_size}

    def _fairest_waiting(self, passed_groups: list[str], reserving: set[str]) -> Sequence | None:
        """Round-robin across clients: the client with the fewest running requests, then the one served
        longest ago, then its oldest request (None when every waiting one is in `passed_groups`). While a group
        reserves slots only reserving groups are candidates."""
        running_per_client = Counter(s.client_id for s in self.running)
        return min((s for s in self.waiting if s.group_id not in passed_groups
                    and (not reserving or s.group_id in reserving)), default=None,
                   key=lambda s: (running_per_client[s.client_id],
                                  self._last_admitted.get(s.client_id, float("-inf")), s.arrival_time))

    def _fits_kv_budget(self, group: list[Sequence]) -> bool:
        """The worker's batch is left-padded to its longest row, so its KV cache holds (rows x longest) tokens:
        admit only while that stays within `max_batch_kv_tokens` (a request alone always fits)."""
        if not self.running:
            return True
        longest = max(s.max_num_tokens for s in [*self.running, *group])
        return (len(self.running) + len(group)) * longest <= self.max_batch_kv_tokens

    def _remember_admission(self, client_id: str) -> None:
        if len(self._last_admitted) >= MAX_REMEMBERED_CLIENTS:  # forget clients with nothing left here
            active = {s.client_id for s in self.sequences.values()}
            self._last_admitted = {c: t for c, t in self._last_admitted.items() if c in active}
        self._last_admitted[client_id] = time.monotonic()

    def _finish(self, seq: Sequence, reason: FinishReason, error: Exception | None = None) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.finished_ids.append(seq.request_id)  # the worker frees its state (after a crash: cleared)
        del self.sequences[seq.request_id]
        self._passed.pop(seq.group_id, None)
        try:
            output = seq.finish(reason, error)
        except Exception as exc:  # noqa: BLE001 - its last text (flush) failed: it fails alone, its waiter still hears
            logger.exception("finishing %s failed", seq.request_id)
            output = seq.finish(FinishReason.ERROR, RequestFailed(f"internal error: {type(exc).__name__}"))
        self.observer.on_finish(seq, output)
        if not self.sequences:
            self._is_idle.notify_all()


def _new_requests(admitted: list[Sequence]) -> tuple[NewRequest, ...]:
    """One NewRequest per request: a group's samples share one (one prefill in the worker)."""
    groups: dict[str, list[Sequence]] = {}
    for seq in admitted:
        groups.setdefault(seq.group_id, []).append(seq)
    return tuple(seqs[0].to_new_request(tuple(s.request_id for s in seqs) if len(seqs) > 1 else ())
                 for seqs in groups.values())

"""Scheduler: the waiting queue, the running batch and the admission policy; nothing else.

Request threads call `add` and `abort`; the one scheduler thread calls `schedule` (blocks while
there is nothing to do). One lock guards the queues and every sequence's status, and it is never
held for text work: a sequence that finishes is only marked here (`Finished`); the output side
builds its final output afterwards, then `release`s it.

Admission: the policy says when the batch takes new sequences (AdmissionPolicy), each client may
hold at most `max_queue_per_client` waiting requests and slots go round-robin across clients
(ClientFairness), a request's samples go in together, one that does not fit is passed by a batch's worth
of others at most (GroupReservations), and the worker's keys and
values stay within `max_batch_kv_tokens`: the sum of the rows' prompt and answer tokens where each row
holds its own (`kv_per_row`, the 4-bit path), else rows x the longest row (a batch padded to it). A
request past its deadline fails with deadline_exceeded, waiting or running.
"""
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .errors import DeadlineExceeded, EngineError, Overloaded, ShuttingDown
from .messages import FinishReason, NewRequest
from .sequence import Sequence, SequenceStatus

MAX_REMEMBERED_CLIENTS = 4096


@dataclass(frozen=True)
class Finished:
    """A sequence the scheduler has taken out of its queues; the output side still owes its final output."""
    seq: Sequence
    reason: FinishReason
    error: Exception | None = None
    was_running: bool = False  # its text may be in use on the scheduler thread


@dataclass(frozen=True)
class StepPlan:
    new_requests: tuple[NewRequest, ...] = ()
    finished_ids: tuple[str, ...] = ()
    finished: tuple[Finished, ...] = ()  # aborted or past their deadline: their outputs go out before the step
    has_step: bool = True  # False: only `finished` to deliver, no round-trip to run


class AdmissionPolicy:
    """Continuous batching: a slot that frees is refilled at the next step."""

    def __init__(self, max_batch_size: int):
        self.max_batch_size = max_batch_size

    def can_admit(self, num_running: int) -> bool:
        return num_running < self.max_batch_size


class StaticBatching(AdmissionPolicy):
    """The batch runs to completion before the next one is admitted."""

    def can_admit(self, num_running: int) -> bool:
        return num_running == 0


class NoBatching(StaticBatching):
    """One request at a time (a baseline to measure batching against)."""

    def __init__(self, max_batch_size: int):
        super().__init__(1)


POLICIES = {"continuous": AdmissionPolicy, "static": StaticBatching, "none": NoBatching}


def admission_policy(name: str, max_batch_size: int) -> AdmissionPolicy:
    return POLICIES.get(name, StaticBatching)(max_batch_size)


class ClientFairness:
    """Round-robin across clients: the client with the fewest running requests, then the one served longest
    ago, then its oldest request, so one client that keeps the queue full cannot lock the others out."""

    def __init__(self):
        self._last_admitted: dict[str, float] = {}  # client id -> when it last got a slot

    def fairest(self, candidates: Iterable[Sequence], running: list[Sequence]) -> Sequence | None:
        running_per_client = Counter(s.client_id for s in running)
        return min(candidates, default=None,
                   key=lambda s: (running_per_client[s.client_id],
                                  self._last_admitted.get(s.client_id, float("-inf")), s.arrival_time))

    def on_admit(self, client_id: str, active_clients: Callable[[], set[str]]) -> None:
        if len(self._last_admitted) >= MAX_REMEMBERED_CLIENTS:  # forget clients with nothing left here
            active = active_clients()
            self._last_admitted = {c: t for c, t in self._last_admitted.items() if c in active}
        self._last_admitted[client_id] = time.monotonic()


class GroupReservations:
    """A group (a request's samples, or a request alone) is admitted all at once. One that does not fit yet (slots,
    KV room) does not hold up the requests behind it, until a batch's worth of sequences has gone past it: then it
    reserves the slots and room as they free (it cannot be starved)."""

    def __init__(self, max_batch_size: int):
        self.max_batch_size = max_batch_size
        self._passed: Counter[str] = Counter()  # waiting group id -> sequences admitted past it

    def reserving(self) -> set[str]:
        """Waiting groups that a batch's worth of sequences went past: the slots that free are theirs."""
        return {group_id for group_id, count in self._passed.items() if count >= self.max_batch_size}

    def may_be_passed(self, group_id: str) -> bool:
        return self._passed[group_id] < self.max_batch_size

    def on_admit(self, group_id: str, num_sequences: int, passed_groups: list[str]) -> None:
        """`group_id` got its slots; the groups it went past (this round) count its sequences."""
        self._passed.pop(group_id, None)
        self._passed.update({passed: num_sequences for passed in passed_groups})

    def forget(self, group_id: str) -> None:
        self._passed.pop(group_id, None)


class Scheduler:
    def __init__(self, max_batch_size: int = 8, max_queue: int = 64, policy: str = "continuous",
                 max_queue_per_client: int | None = None, max_batch_kv_tokens: int | None = None):
        self.policy = admission_policy(policy, max_batch_size)
        self.max_batch_size = self.policy.max_batch_size
        self.max_queue = max_queue
        self.max_queue_per_client = max_queue_per_client or max_queue
        self.max_batch_kv_tokens = max_batch_kv_tokens or float("inf")
        self.kv_per_row = False  # the worker's say (ModelInfo.kv_per_row): see `_fits_kv_budget`
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}  # until released: the final output is delivered
        self.finished_ids: list[str] = []  # the worker still holds their KV cache
        self.fairness = ClientFairness()
        self.reservations = GroupReservations(self.max_batch_size)
        self._lock = threading.Lock()
        self._has_work = threading.Condition(self._lock)
        self._is_idle = threading.Condition(self._lock)
        self._is_closed = False

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
                raise ShuttingDown()
            if len(self.waiting) + len(seqs) > self.max_queue:
                raise Overloaded(f"the queue is full ({self.max_queue} waiting requests); retry later")
            held = sum(s.client_id == client_id for s in self.waiting)
            if held + len(seqs) > self.max_queue_per_client:
                raise Overloaded(f"this client may hold at most {self.max_queue_per_client} waiting requests "
                                 f"({held} waiting, {len(seqs)} more asked); wait for some to finish")
            for seq in seqs:
                if seq.request_id in self.sequences or seq.group_id in self.sequences:
                    raise ValueError(f"request id {seq.request_id!r} is already in use")
            self.waiting.extend(seqs)
            self.sequences.update((seq.request_id, seq) for seq in seqs)
            self._has_work.notify()

    def abort(self, request_id: str) -> tuple[bool, list[Finished]]:
        """Cancel a request (all its samples): (whether it was here, the waiting ones finished now). A running one
        stops and frees its slot at the next step."""
        with self._lock:
            seqs = [self.sequences[request_id]] if request_id in self.sequences \
                else [s for s in self.sequences.values() if s.group_id == request_id]
            seqs = [s for s in seqs if not s.is_finished]
            finished = []
            for seq in seqs:
                if seq.status is SequenceStatus.WAITING:
                    finished.append(self._mark_finished(seq, FinishReason.ABORT))
                else:
                    seq.is_abort_requested = True
                    self._has_work.notify()
            return bool(seqs), finished

    def schedule(self, timeout: float | None = None) -> StepPlan | None:
        """Block until there is a step to run (or `timeout`/close); admit new requests by policy. None: nothing
        to run and nothing finished."""
        with self._lock:
            self._has_work.wait_for(lambda: self._is_closed or self._needs_step(), timeout)
            if self._is_closed:
                return None
            finished = self._expire(time.monotonic())  # also on a timeout: a deadline passes while idle
            if not self._needs_step():
                return StepPlan(finished=tuple(finished), has_step=False) if finished else None
            finished += [self._mark_finished(seq, FinishReason.ABORT)
                         for seq in [s for s in self.running if s.is_abort_requested]]
            admitted = self._admit()
            plan = StepPlan(_new_requests(admitted), tuple(self.finished_ids), tuple(finished))
            self.finished_ids.clear()
            return plan

    def running_now(self) -> list[Sequence]:
        with self._lock:
            return list(self.running)

    def finish(self, seq: Sequence, reason: FinishReason, error: Exception | None = None) -> list[Finished]:
        """Take a sequence out (the output side saw it end): [] if it was finished already."""
        with self._lock:
            return [] if seq.is_finished else [self._mark_finished(seq, reason, error)]

    def release(self, seq: Sequence) -> None:
        """Its final output is delivered: its id is free again, and the engine may be idle."""
        with self._lock:
            if self.sequences.get(seq.request_id) is seq:
                del self.sequences[seq.request_id]
            if not self.sequences:
                self._is_idle.notify_all()

    def fail_running(self, error: EngineError) -> list[Finished]:
        """The worker is gone: fail what it was computing; waiting requests wait for the next worker."""
        with self._lock:
            finished = [self._mark_finished(seq, FinishReason.ERROR, error) for seq in list(self.running)]
            self.finished_ids.clear()
            return finished

    def fail_all(self, error: EngineError) -> list[Finished]:
        with self._lock:
            finished = [self._mark_finished(seq, FinishReason.ERROR, error)
                        for seq in list(self.running) + list(self.waiting)]
            self.finished_ids.clear()
            return finished

    def fail_waiting_longer_than(self, max_tokens: int, error: EngineError) -> list[Finished]:
        """Waiting requests past a restarted worker's context (it measured less memory): alone, they would run."""
        with self._lock:
            return [self._mark_finished(seq, FinishReason.ERROR, error)
                    for seq in [s for s in self.waiting if s.max_num_tokens > max_tokens]]

    def wait_idle(self, timeout: float) -> bool:
        with self._lock:
            return self._is_idle.wait_for(lambda: not self.sequences, timeout)

    def close(self) -> None:
        with self._lock:
            self._is_closed = True
            self._has_work.notify_all()

    def _needs_step(self) -> bool:
        return bool(self.running or self.finished_ids or (self.waiting and self._can_admit()))

    def _can_admit(self) -> bool:
        return self.policy.can_admit(len(self.running))

    def _expire(self, now: float) -> list[Finished]:
        return [self._mark_finished(seq, FinishReason.ERROR, DeadlineExceeded(
                    f"the request did not finish within its deadline ({seq.num_output_tokens} tokens generated)"))
                for seq in [s for s in self.sequences.values() if s.deadline <= now and not s.is_finished]]

    def _admit(self) -> list[Sequence]:
        if not self._can_admit():
            return []
        admitted, passed_groups = [], []
        now = time.monotonic()
        while len(self.running) < self.max_batch_size:
            seq = self._fairest_waiting(passed_groups, self.reservations.reserving())
            if seq is None:
                break
            group = [s for s in self.waiting if s.group_id == seq.group_id]
            if not self._fits(group):
                if not self.reservations.may_be_passed(seq.group_id):
                    break  # the batch drains until it fits: skipping to smaller requests for ever would starve it
                passed_groups.append(seq.group_id)  # it waits for slots or KV room; others may go past it, a while
                continue
            self.reservations.on_admit(seq.group_id, len(group), passed_groups)
            self.fairness.on_admit(seq.client_id, lambda: {s.client_id for s in self.sequences.values()})
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

    def _fairest_waiting(self, passed_groups: list[str], reserving: set[str]) -> Sequence | None:
        """The fairest waiting sequence (None when every waiting one is in `passed_groups`). While a group
        reserves slots only reserving groups are candidates."""
        return self.fairness.fairest((s for s in self.waiting if s.group_id not in passed_groups
                                      and (not reserving or s.group_id in reserving)), self.running)

    def _fits_kv_budget(self, group: list[Sequence]) -> bool:
        """Admit only while the worker's keys and values stay within `max_batch_kv_tokens` (a request alone always
        fits): each row's own prompt and answer where rows keep their own caches, else (a batch padded to its
        longest row) rows x the longest."""
        if not self.running:
            return True
        batch = [*self.running, *group]
        if self.kv_per_row:
            return sum(s.max_num_tokens for s in batch) <= self.max_batch_kv_tokens
        return len(batch) * max(s.max_num_tokens for s in batch) <= self.max_batch_kv_tokens

    def _mark_finished(self, seq: Sequence, reason: FinishReason, error: Exception | None = None) -> Finished:
        was_running = seq.status is SequenceStatus.RUNNING
        if was_running:
            self.running.remove(seq)
            self.finished_ids.append(seq.request_id)  # the worker frees its state (after a crash: cleared)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.reservations.forget(seq.group_id)
        return Finished(seq, reason, error, was_running)


def _new_requests(admitted: list[Sequence]) -> tuple[NewRequest, ...]:
    """One NewRequest per request: a group's samples share one (one prefill in the worker)."""
    groups: dict[str, list[Sequence]] = {}
    for seq in admitted:
        groups.setdefault(seq.group_id, []).append(seq)
    return tuple(seqs[0].to_new_request(tuple(s.request_id for s in seqs) if len(seqs) > 1 else ())
                 for seqs in groups.values())

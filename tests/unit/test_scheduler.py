"""Scheduler with a scripted worker: admission by policy, queue bounds, aborts, frees."""
import queue
import threading
import time

import pytest

from engine import FinishReason, NotReady, Overloaded
from engine.detokenizer import IncrementalDetokenizer
from engine.engine_core import EngineCore
from engine.messages import ModelInfo, StepOutput, WorkerSampling
from engine.output_processor import RequestState
from engine.outputs import RequestOutput
from engine.scheduler import Scheduler
from engine.sequence import Sequence

from ..client import wait_until


class CharTokenizer:
    """One token per character: enough for the scheduler's bookkeeping."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != 0)


def make_state(seq: Sequence, sink=None) -> RequestState:
    return RequestState(seq, IncrementalDetokenizer(CharTokenizer()), queue.Queue() if sink is None else sink,
                        frozenset({0}))


def make_seq(request_id: str, max_tokens: int = 3) -> RequestState:
    return make_state(Sequence(request_id, [65, 66], WorkerSampling(max_tokens=max_tokens)))


def make_core(**options) -> EngineCore:
    """The scheduler and the output side joined as in the engine, with no worker: the tests answer for it."""
    return EngineCore(Scheduler(**options))


def run_step(manager: EngineCore, token: int = 120):
    """What the engine loop does, with a worker that answers `token` for every running request."""
    plan = manager.schedule(timeout=0)
    manager.process(StepOutput({seq.request_id: (token,) for seq in manager.scheduler.running}))
    return plan


def outputs(seq: RequestState) -> RequestOutput:
    items = []
    while not seq.sink.empty():
        items.append(seq.sink.get())
    return items[-1]


def test_continuous_admits_up_to_the_batch_size_and_refills_between_steps():
    manager = make_core(max_batch_size=2, policy="continuous")
    seqs = [make_seq("a", 1), make_seq("b", 3), make_seq("c", 3)]
    for seq in seqs:
        manager.add_states([seq])
    plan = run_step(manager)
    assert [r.request_id for r in plan.new_requests] == ["a", "b"]
    plan = run_step(manager)  # a finished after 1 token, so c joins while b keeps running
    assert [r.request_id for r in plan.new_requests] == ["c"] and plan.finished_ids == ("a",)


def test_static_waits_for_the_whole_batch():
    manager = make_core(max_batch_size=2, policy="static")
    for seq in (make_seq("a", 1), make_seq("b", 3), make_seq("c", 1)):
        manager.add_states([seq])
    admitted = [[r.request_id for r in run_step(manager).new_requests] for _ in range(4)]
    assert admitted == [["a", "b"], [], [], ["c"]]


def test_none_runs_one_request_at_a_time():
    manager = make_core(max_batch_size=8, policy="none")
    for seq in (make_seq("a", 2), make_seq("b", 2)):
        manager.add_states([seq])
    admitted = [[r.request_id for r in run_step(manager).new_requests] for _ in range(3)]
    assert admitted == [["a"], [], ["b"]]


def test_full_queue_raises_overloaded_instead_of_blocking():
    manager = make_core(max_batch_size=1, max_queue=2)
    manager.add_states([make_seq("a")])
    manager.add_states([make_seq("b")])
    with pytest.raises(Overloaded):
        manager.add_states([make_seq("c")])


def test_abort_waiting_finishes_at_once_and_running_at_the_next_step():
    manager = make_core(max_batch_size=1)
    running, waiting = make_seq("a", 10), make_seq("b")
    manager.add_states([running])
    manager.add_states([waiting])
    run_step(manager)
    assert manager.abort("b") and outputs(waiting).finish_reason is FinishReason.ABORT
    assert manager.abort("a") and manager.scheduler.num_running == 1  # still holds its slot until the next step
    plan = manager.schedule(timeout=0)
    assert plan.finished_ids == ("a",) and manager.scheduler.num_running == 0
    assert outputs(running).finish_reason is FinishReason.ABORT and not manager.abort("a")


def test_eos_and_length_finish_reasons_and_usage():
    manager = make_core()
    eos, length = make_seq("eos", 5), make_seq("len", 2)
    manager.add_states([eos])
    manager.add_states([length])
    manager.schedule(timeout=0)
    manager.process(StepOutput({"eos": (72,), "len": (72,)}))
    manager.process(StepOutput({"eos": (0,), "len": (73,)}))
    assert outputs(eos).finish_reason is FinishReason.STOP
    out = outputs(length)
    assert out.finish_reason is FinishReason.LENGTH
    assert out.text == "HI" and out.usage.completion_tokens == 2 and out.usage.prompt_tokens == 2


def test_schedule_blocks_until_work_arrives_and_returns_none_on_timeout():
    manager = make_core()
    assert manager.schedule(timeout=0.05) is None
    manager.scheduler.close()
    assert manager.schedule(timeout=None) is None


def make_long_seq(request_id: str, num_prompt_tokens: int, max_tokens: int) -> RequestState:
    return make_state(Sequence(request_id, [65] * num_prompt_tokens, WorkerSampling(max_tokens=max_tokens)))


def test_the_padded_batch_stays_within_its_kv_budget_and_a_long_request_is_passed_only_a_while():
    """A request that does not fit beside the running ones lets later, smaller ones go past it (it would hold them
    all up), a batch's worth at most (max_batch_size); then it reserves: nobody else is admitted until it fits."""
    manager = make_core(max_batch_size=4, max_batch_kv_tokens=1000)
    for i in range(3):
        manager.add_states([make_long_seq(f"short-{i}", 40, 60)])  # 100 tokens each
    manager.add_states([make_long_seq("long", 300, 100)])  # 400: with 3 others, 4 rows x 400 = 1600 > 1000
    for i in range(8):
        manager.add_states([make_long_seq(f"late-{i}", 40, 60)])
    admitted = [r.request_id for r in manager.schedule(timeout=0).new_requests]
    assert admitted == ["short-0", "short-1", "short-2", "late-0"]  # late-0 went past it
    while "long" not in admitted:
        manager.abort(manager.scheduler.running[0].request_id)
        admitted += [r.request_id for r in manager.schedule(timeout=0).new_requests]
        assert len(manager.scheduler.running) <= 4
    assert admitted[3:] == ["late-0", "late-1", "late-2", "late-3", "long"]  # then the batch drained for it
    assert manager.scheduler.running[-1].request_id == "long" and len(manager.scheduler.running) == 2


def test_rows_that_keep_their_own_caches_count_only_their_own_tokens():
    """The 4-bit path (ModelInfo.kv_per_row): the budget bounds the sum of the rows' prompt and answer tokens, so a
    long request leaves room to the short ones the padded count would hold back; past the sum one waits."""
    manager = make_core(max_batch_size=8, max_batch_kv_tokens=1000)
    info = ModelInfo("m", "hf", "float32", "cpu", max_model_len=500, eos_token_ids=(0,), kv_per_row=True)
    manager.executor = RestartedWorker(info)
    assert manager._start_worker() and manager.scheduler.kv_per_row
    for request_id, prompt, answer in (("long", 300, 100), *((f"short-{i}", 40, 60) for i in range(4)),
                                       ("long-2", 300, 100)):
        manager.add_states([make_long_seq(request_id, prompt, answer)])
    plan = manager.schedule(timeout=0)  # 400 + 4 x 100 = 800; another 400 would be 1200
    assert [r.request_id for r in plan.new_requests] == ["long", *(f"short-{i}" for i in range(4))]
    manager.abort("short-0")
    manager.abort("short-1")
    assert [r.request_id for r in manager.schedule(timeout=0).new_requests] == ["long-2"]  # 1000: fits, just


def test_a_request_whose_last_text_fails_fails_alone():
    """The flush at its end raises (a tokenizer bug): that request gets its error, the step goes on, and nothing is
    finished twice (which was a KeyError out of postprocess: every running request failed, this one never heard)."""
    manager = make_core(max_batch_size=4)
    broken, other = make_seq("req-2-broken", 1), make_seq("other", 2)

    def failing_flush():
        raise ValueError("cannot decode")

    broken.detokenizer.flush = failing_flush
    manager.add_states([broken])
    manager.add_states([other])
    run_step(manager)
    failed = outputs(broken)
    assert failed.finish_reason is FinishReason.ERROR and failed.error_code == "request_failed"
    assert [seq.request_id for seq in manager.scheduler.running] == ["other"]
    run_step(manager)
    finished = outputs(other)
    assert finished.finish_reason is FinishReason.LENGTH and finished.text == "xx"
    assert not manager.scheduler.sequences


def make_samples(request_id: str, num_samples: int, max_tokens: int = 3) -> list[RequestState]:
    """A request with n = `num_samples`: sequences sharing one group id (as Engine.submit queues them)."""
    return [make_state(Sequence(f"{request_id}#{i}", [65, 66], WorkerSampling(max_tokens=max_tokens),
                                group_id=request_id, sample_index=i)) for i in range(num_samples)]


def admitted_ids(plan) -> list[str]:
    return [r.request_id for r in plan.new_requests]


def test_a_single_request_is_admitted_past_a_group_that_does_not_fit_yet():
    """No head-of-line blocking: a group waiting for slots does not keep a short request behind it waiting."""
    manager = make_core(max_batch_size=4)
    for name in ("long-a", "long-b"):
        manager.add_states([make_seq(name, 100)])
    run_step(manager)
    manager.add_states(make_samples("group", 3))  # 2 running + 3 > 4
    manager.add_states([make_seq("short", 2)])
    assert admitted_ids(run_step(manager)) == ["short"]
    assert sorted(s.request_id for s in manager.scheduler.waiting) == ["group#0", "group#1", "group#2"]


def test_a_group_passed_by_a_batch_of_requests_reserves_the_slots_that_free():
    """Not starved: once a batch's worth of sequences went past it, later requests wait and the group goes next."""
    manager = make_core(max_batch_size=4)
    for name in ("long-a", "long-b"):
        manager.add_states([make_seq(name, 100)])
    run_step(manager)
    manager.add_states(make_samples("group", 3))
    for i in range(4):  # each finishes in one step, so a slot is free for the next
        manager.add_states([make_seq(f"short-{i}", 1)])
        assert admitted_ids(run_step(manager)) == [f"short-{i}"]
    manager.add_states([make_seq("late", 1)])
    assert admitted_ids(run_step(manager)) == []  # two slots are free, but they are the group's now
    manager.abort("long-a")
    assert admitted_ids(run_step(manager)) == ["group"]
    assert [s.request_id for s in manager.scheduler.waiting] == ["late"]


class BlockingTokenizer(CharTokenizer):
    """Decoding waits until the test lets it go: text work that takes long."""

    def __init__(self):
        self.is_decoding, self.may_go_on = threading.Event(), threading.Event()

    def decode(self, ids, skip_special_tokens=True):
        if ids and not self.may_go_on.is_set():
            self.is_decoding.set()
            self.may_go_on.wait(10)
        return super().decode(ids)


def start_a_slow_step(manager: EngineCore, max_tokens: int) -> tuple[RequestState, BlockingTokenizer, threading.Thread]:
    tokenizer = BlockingTokenizer()
    slow = RequestState(Sequence("slow", [65, 66], WorkerSampling(max_tokens=max_tokens)),
                        IncrementalDetokenizer(tokenizer), queue.Queue(), frozenset({0}))
    manager.add_states([slow])
    manager.schedule(timeout=0)
    step = threading.Thread(target=manager.process, args=(StepOutput({"slow": (120,)}),))
    step.start()
    assert tokenizer.is_decoding.wait(10)
    return slow, tokenizer, step


def events_of(state: RequestState) -> list:
    events = []
    while not state.sink.empty():
        events.append(state.sink.get())
    return events


def test_requests_are_queued_and_cancelled_while_a_step_is_detokenized():
    """Text work runs outside the scheduler's lock; a cancelled running request still hears its deltas first."""
    manager = make_core(max_batch_size=2)
    slow, tokenizer, step = start_a_slow_step(manager, max_tokens=5)
    started = time.monotonic()
    late = make_seq("late")
    manager.add_states([late])
    assert manager.abort("late") and manager.abort("slow")
    assert time.monotonic() - started < 5  # neither waited for the decode
    assert outputs(late).finish_reason is FinishReason.ABORT
    tokenizer.may_go_on.set()
    step.join(10)
    manager.schedule(timeout=0)
    events = events_of(slow)
    assert [e.text for e in events[:-1]] == ["x"] and events[-1].finish_reason is FinishReason.ABORT


def test_a_request_failed_from_another_thread_mid_step_gets_one_final_output_after_its_deltas():
    """The shutdown fails every request while the scheduler thread is still streaming one that is ending."""
    manager = make_core(max_batch_size=2)
    slow, tokenizer, step = start_a_slow_step(manager, max_tokens=1)
    failing = threading.Thread(target=manager.fail_all, args=(NotReady("the server is shutting down"),))
    failing.start()
    wait_until(lambda: slow.seq.is_finished)
    tokenizer.may_go_on.set()
    step.join(10)
    failing.join(10)
    events = events_of(slow)
    assert [type(e).__name__ for e in events] == ["DeltaEvent", "RequestOutput"]
    assert events[-1].error_code == "not_ready" and not manager.scheduler.sequences


class RestartedWorker:
    """An executor whose new worker measured less memory: a smaller context and KV budget (fault injection)."""

    def __init__(self, info: ModelInfo):
        self.info = info

    def start(self) -> ModelInfo:
        return self.info


def test_a_restarted_worker_with_a_smaller_context_fails_the_waiting_requests_past_it():
    manager = make_core(max_batch_size=8, max_batch_kv_tokens=32768)
    long, short = make_long_seq("long", 300, 100), make_long_seq("short", 40, 60)
    manager.add_states([long])
    manager.add_states([short])
    info = ModelInfo("m", "hf", "float32", "cpu", max_model_len=200, eos_token_ids=(0,), kv_budget_tokens=300)
    manager.info, manager.executor = info, RestartedWorker(info)  # as after a first start
    assert manager._start_worker()
    assert manager.scheduler.max_batch_kv_tokens == 300
    finished = outputs(long)
    assert finished.finish_reason is FinishReason.ERROR and "context of 200 tokens" in finished.error
    assert [s.request_id for s in manager.scheduler.waiting] == ["short"]

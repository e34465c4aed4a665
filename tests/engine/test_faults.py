"""Fault injection on the real worker: the original race, a killed worker, a hung worker, a wrong answer."""
import os
import random
import signal
import threading
import time

import pytest

from engine import CorrelationMismatch, FinishReason, SamplingParams, WorkerFailed
from ..unit.test_channel import FailsToLoadIn
from ..worker_faults import lying_handle_task, patch_worker

PROMPTS = ["Hi", "Tell me a story about dragons.", "1, 2, 3,", "The weather today is"]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


class NoLock:
    """What the original design had around its round-trip: nothing."""

    def acquire(self, timeout=None):
        return True

    def release(self):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        return False


def jitter():
    """The original demo's trick: widen the window between a caller's put and its get."""
    time.sleep(random.uniform(0, 0.002))


def hammer_echo(executor, thread_index: int, num_calls: int, swaps: list, errors: list,
                expected_errors=(CorrelationMismatch, WorkerFailed)):
    for i in range(num_calls):
        payload = f"{thread_index}:{i}"
        try:
            answer = executor.echo(payload, timeout=10)
        except expected_errors as exc:
            errors.append(exc)
            return
        if answer != payload:
            swaps.append((payload, answer))


def test_without_the_mutex_callers_take_each_others_results(make_engine, tiny_model_dir, monkeypatch):
    """Reproduce the original race: concurrent put/get on one queue pair with no lock."""
    engine = make_engine(tiny_model_dir)
    executor = engine.executor
    monkeypatch.setattr(executor, "_round_trip_lock", NoLock())  # undone before the engine shuts down
    executor.after_put_hook = jitter
    swaps, errors = [], []
    # Unlocked, a caller may also find the queues closed under it once another caller killed the worker.
    broken = (CorrelationMismatch, WorkerFailed, ValueError, OSError)
    threads = [threading.Thread(target=hammer_echo, args=(executor, t, 100, swaps, errors, broken))
               for t in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    # Every swap is caught by the correlation id as a loud error; none reaches a caller silently.
    assert any(isinstance(e, CorrelationMismatch) for e in errors)
    assert swaps == []


def test_with_the_mutex_every_caller_gets_its_own_result(make_engine, tiny_model_dir):
    """Streaming, batch and direct executor callers at once, under the same jitter: zero swaps."""
    engine = make_engine(tiny_model_dir)
    expected = {p: engine.generate([p], GREEDY)[0].text for p in PROMPTS}
    engine.executor.after_put_hook = jitter
    swaps, errors, mismatched = [], [], []

    def streamer(prompt):
        for _ in range(4):
            handle = engine.submit(prompt, GREEDY)
            text = "".join(handle)
            if text != expected[prompt] or handle.result().text != expected[prompt]:
                mismatched.append(prompt)

    def batcher():
        for _ in range(4):
            texts = [o.text for o in engine.generate(PROMPTS, GREEDY)]
            if texts != [expected[p] for p in PROMPTS]:
                mismatched.append("batch")

    threads = [threading.Thread(target=streamer, args=(p,)) for p in PROMPTS]
    threads += [threading.Thread(target=batcher) for _ in range(2)]
    threads += [threading.Thread(target=hammer_echo, args=(engine.executor, t, 60, swaps, errors))
                for t in range(4)]
    calls_before = next(engine.executor._call_ids)
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    round_trips = next(engine.executor._call_ids) - calls_before
    # Every echo, and at least one streamer's steps (4 answers one after another, a step per token after the first),
    # went through the one round-trip while the others ran: the count the schedule cannot go below.
    assert round_trips >= 4 * 60 + 4 * (GREEDY.max_tokens - 1)
    assert (swaps, errors, mismatched) == ([], [], [])


def wait_for_restart(engine, timeout=60):
    deadline = time.monotonic() + timeout
    while not engine.check_worker(wait=5):
        assert time.monotonic() < deadline, "the worker was not restarted"
        time.sleep(0.2)


def test_killed_worker_fails_in_flight_requests_then_recovers(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    handles = [engine.submit(p, SamplingParams(max_tokens=200, ignore_eos=True)) for p in PROMPTS[:2]]
    next(iter(handles[0]))
    old_pid = engine.executor.pid
    os.kill(old_pid, signal.SIGKILL)
    for handle in handles:
        output = handle.result(timeout=30)
        assert output.finish_reason is FinishReason.ERROR
        assert output.error_code == "worker_failed" and "died" in output.error
    after = engine.generate(["Hi"], SamplingParams(max_tokens=4), timeout=60)[0]
    assert after.finish_reason is FinishReason.LENGTH and engine.executor.pid != old_pid


def test_hung_worker_is_detected_by_the_timeout_and_replaced(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, step_timeout_s=2.0)
    handle = engine.submit("Hello", SamplingParams(max_tokens=200, ignore_eos=True))
    next(iter(handle))
    os.kill(engine.executor.pid, signal.SIGSTOP)
    output = handle.result(timeout=30)
    assert output.finish_reason is FinishReason.ERROR and "did not answer" in output.error
    wait_for_restart(engine)
    assert engine.generate(["Hi"], SamplingParams(max_tokens=4))[0].finish_reason is FinishReason.LENGTH


def test_a_stopped_idle_worker_cannot_hold_a_large_task_forever(make_engine, tiny_model_dir):
    # The task pipe holds 64 KiB: a larger task is written as the worker reads it, and a worker that stopped
    # reading must fail the call within its timeout, not block the caller for good.
    engine = make_engine(tiny_model_dir)
    engine.wait_idle(30)
    os.kill(engine.executor.pid, signal.SIGSTOP)
    with pytest.raises(WorkerFailed, match="stopped taking tasks"):
        engine.executor.echo("x" * 1_000_000, timeout=2.0)
    wait_for_restart(engine)
    assert engine.executor.echo("y" * 1_000_000) == "y" * 1_000_000


def test_an_answer_the_parent_cannot_read_fails_the_call_and_restarts_the_worker(make_engine, tiny_model_dir):
    # A result that does not unpickle here must not stay at the head of the pipe and fail every later call.
    engine = make_engine(tiny_model_dir)
    engine.wait_idle(30)
    with pytest.raises(WorkerFailed, match="could not be read"):
        engine.executor.echo(FailsToLoadIn(os.getpid()))  # loads in the worker, not back here
    wait_for_restart(engine)
    assert engine.executor.echo("after") == "after"


def test_a_result_for_another_call_is_a_loud_error(make_engine, tiny_model_dir, monkeypatch):
    patch_worker(monkeypatch, handle_task=lying_handle_task)
    engine = make_engine(tiny_model_dir)
    with pytest.raises(CorrelationMismatch):
        engine.executor.echo("lie")
    wait_for_restart(engine)
    assert engine.executor.echo("truth") == "truth"


def test_a_worker_dying_between_steps_fails_its_requests(make_engine, tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir)
    real_postprocess = engine.core.process
    killed = []

    def kill_after_this_step(output):
        real_postprocess(output)
        if not killed:  # the worker dies while the parent is between two round-trips
            killed.append(engine.executor.pid)
            os.kill(killed[0], signal.SIGKILL)
            engine.executor._process.join(10)

    monkeypatch.setattr(engine.core, "process", kill_after_this_step)
    output = engine.submit("Hello", SamplingParams(max_tokens=50, ignore_eos=True)).result(timeout=60)
    assert output.finish_reason is FinishReason.ERROR and "between steps" in output.error
    assert engine.generate(["Hi"], SamplingParams(max_tokens=3))[0].finish_reason is FinishReason.LENGTH
    assert engine.executor.pid != killed[0]


def test_the_scheduler_loop_survives_a_bug(make_engine, tiny_model_dir, monkeypatch):
    engine = make_engine(tiny_model_dir)
    real_postprocess = engine.core.process
    raised = []

    def buggy_postprocess(output):
        if not raised:
            raised.append(True)
            raise IndexError("a bug in postprocess")
        real_postprocess(output)

    monkeypatch.setattr(engine.core, "process", buggy_postprocess)
    output = engine.submit("Hello", SamplingParams(max_tokens=20, ignore_eos=True)).result(timeout=60)
    assert output.finish_reason is FinishReason.ERROR and "IndexError" in output.error
    assert engine.generate(["Hi"], SamplingParams(max_tokens=3))[0].finish_reason is FinishReason.LENGTH

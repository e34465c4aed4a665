"""ModelExecutor: owns the forked model worker and the one mutex-guarded round-trip to it.

Whoever calls (the scheduler thread, a readiness probe, a test), a task is put and its
result taken inside `call`, under one lock: exactly one round-trip is in flight. The
worker echoes the task's `call_id`; a result for any other call raises
CorrelationMismatch instead of being handed to the wrong caller. A worker that dies or
exceeds the timeout is killed and reported as WorkerFailed; `start` forks a new one.

The worker is forked by the process's fork server (engine/fork_server.py), a fresh Python
started with the first executor: never by this process, whose other threads a fork would
leave holding their locks in the child.
"""
import atexit
import dataclasses
import itertools
import logging
import os
import signal
import threading
import time

from .channel import Channel, ChannelBroken, ChannelClosed, pipe_pair
from .config import EngineConfig
from .errors import CorrelationMismatch, WorkerBusy, WorkerFailed
from .fork_server import ForkedProcess, shared_fork_server
from .messages import (EchoTask, ModelInfo, NewRequest, Result, ShutdownTask, StepResult,
                       StepTask, Task, WorkerFailure)
from .worker import run_worker  # the worker's entry point, looked up at each fork (tests put a patched one here)

logger = logging.getLogger(__name__)

LIVENESS_CHECK_S = 0.2  # how often a wait for the worker's answer looks at whether it still lives
SHUTDOWN_SEND_S = 1.0
TASK_WORDS = {StepTask: "computing the next tokens", EchoTask: "answering a readiness check"}  # for error messages


class ModelExecutor:
    def __init__(self, config: EngineConfig, model_path: str, backend: str = "hf"):
        self.config = config
        self.model_path = model_path
        self.backend = backend
        # the worker's imports made once, in the process's fork server (vLLM's read the environment that the worker
        # sets first: its worker imports for itself)
        self._fork_server = shared_fork_server(("engine.backends.hf",) if backend == "hf" else ())
        self._round_trip_lock = threading.Lock()
        self._call_ids = itertools.count(1)
        self._process: ForkedProcess | None = None
        self._is_loaded = False
        self._is_closed = False  # after shutdown, never fork again
        self._channel: Channel | None = None
        self.after_put_hook = None  # tests: widen the put→get window, as in the original race demo
        self._last_answer_time = float("-inf")  # time.monotonic() of the last result the worker sent
        self._call_started: float | None = None  # when the round-trip in flight began

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def fork_server_pid(self) -> int | None:
        return self._fork_server.pid

    def is_alive(self) -> bool:
        """True when a worker has loaded its model and still runs."""
        return self._is_loaded and self._process is not None and self._process.is_alive()

    def seconds_since_answer(self) -> float:
        return time.monotonic() - self._last_answer_time

    def is_in_step_time(self) -> bool:
        """A round-trip is in flight and not yet overdue: the worker is busy, not hung."""
        started = self._call_started
        return started is not None and time.monotonic() - started < self.config.step_timeout_s

    def start(self) -> ModelInfo:
        """Fork the worker and wait until it has loaded the model."""
        with self._round_trip_lock:
            if self._is_closed:
                raise WorkerFailed("the executor is shut down")
            self._kill()
            try:
                self._channel, worker_end = pipe_pair()
            except OSError as exc:  # out of file descriptors
                raise WorkerFailed(f"cannot open pipes to the model worker: {exc}") from exc
            try:
                self._process = self._fork_worker(worker_end)
            except OSError as exc:  # out of processes or memory, or no fork server: a clear failure the engine retries
                self._channel.close()
                raise WorkerFailed(f"cannot fork the model worker: {exc}") from exc
            finally:
                worker_end.close()  # the worker has its own copy: its exit then reads as EOF here
            ready = self._get_result(self.config.load_timeout_s, "loading the model")
            if isinstance(ready, WorkerFailure):
                self._kill()
                raise WorkerFailed(f"the model worker could not load {self.model_path}: {ready.message}")
            self._is_loaded = True
            logger.info("model worker %d ready: %s", self._process.pid, ready.info)
            return ready.info

    def step(self, new_requests: tuple[NewRequest, ...], finished_ids: tuple[str, ...]) -> StepResult:
        return self.call(StepTask(0, new_requests, finished_ids))

    def echo(self, payload: str, timeout: float | None = None, lock_timeout: float | None = None) -> str:
        return self.call(EchoTask(0, payload), timeout, lock_timeout).payload

    def call(self, task: Task, timeout: float | None = None, lock_timeout: float | None = None) -> Result:
        """The only round-trip to the worker: put a task, take its result, check the correlation id.

        `timeout` bounds the worker's answer (past it the worker counts as hung and is killed);
        `lock_timeout` bounds the wait for another caller's round-trip (past it: WorkerBusy, no kill)."""
        timeout = timeout or self.config.step_timeout_s
        lock_timeout = lock_timeout or timeout
        if not self._round_trip_lock.acquire(timeout=lock_timeout):
            raise WorkerBusy(f"the model worker stayed busy for {lock_timeout:.0f} s")
        self._call_started = time.monotonic()
        try:
            return self._round_trip(task, timeout)
        finally:
            self._call_started = None
            self._round_trip_lock.release()

    def _round_trip(self, task: Task, timeout: float) -> Result:
        if not self.is_alive():
            raise WorkerFailed("the model worker is not running")
        call_id = next(self._call_ids)
        task = dataclasses.replace(task, call_id=call_id)
        deadline = time.monotonic() + timeout  # one bound for the send and the answer together
        try:
            self._channel.send(task, timeout)
        except (TimeoutError, ChannelClosed):  # ChannelBroken too: an earlier send was cut off
            self._kill()
            raise WorkerFailed("the model worker stopped taking tasks") from None
        if self.after_put_hook:
            self.after_put_hook()
        result = self._get_result(timeout, TASK_WORDS.get(type(task), "answering"), deadline)
        if result.call_id != call_id:
            self._kill()
            raise CorrelationMismatch(
                f"call {call_id} ({type(task).__name__}) received the result of call {result.call_id}")
        if isinstance(result, WorkerFailure):
            self._kill()
            raise WorkerFailed(f"the model worker failed: {result.message}")
        return result

    def discard_worker(self) -> None:
        """Kill the worker whose state can no longer be trusted; `start` forks a fresh one."""
        with self._round_trip_lock:
            self._kill()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit; if a load or step holds the worker past `timeout`, kill it instead
        (its caller then sees the death and raises WorkerFailed)."""
        self._is_closed = True
        if not self._round_trip_lock.acquire(timeout=timeout):
            process = self._process
            if process is not None:
                logger.warning("model worker busy at shutdown; killing it")
                _kill_group(process.pid)
            return
        try:
            if self.is_alive():
                try:
                    self._channel.send(ShutdownTask(), SHUTDOWN_SEND_S)
                    self._process.join(timeout)
                except (TimeoutError, ChannelClosed):
                    logger.warning("model worker did not take the shutdown task")
            self._kill()
        finally:
            self._round_trip_lock.release()

    def _fork_worker(self, worker_end: Channel) -> ForkedProcess:
        # The worker starts with this process's environment. vLLM forks its own workers from it after loading a
        # tokenizer: a fork must not copy tokenizers' thread pool, whose locks would be held forever in the child.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        process = self._fork_server.start_process(
            run_worker, (self.config, self.model_path, self.backend), worker_end)
        # At exit the worker and its process group go at once (the fork server, whose socket then closes, would
        # end them too).
        atexit.register(self._kill)
        logger.info("forked model worker %d for %s", process.pid, self.model_path)
        return process

    def _get_result(self, timeout: float, what: str, deadline: float | None = None) -> Result:
        deadline = deadline or time.monotonic() + timeout
        process, channel = self._process, self._channel
        while True:
            try:
                result = channel.receive(LIVENESS_CHECK_S)
            except TimeoutError:
                pass
            except ChannelBroken as exc:
                self._kill()
                raise WorkerFailed(f"the model worker's answer could not be read while {what}: {exc}") from None
            except ChannelClosed:
                process.join(LIVENESS_CHECK_S)  # its exit code, if it is exiting
            else:
                self._last_answer_time = time.monotonic()
                return result
            if not process.is_alive():
                how = "its fork server died" if process.exitcode is None else f"exit code {process.exitcode}"
                self._kill()
                raise WorkerFailed(f"the model worker died ({how}) while {what}")
            if time.monotonic() > deadline:
                self._kill()
                raise WorkerFailed(f"the model worker did not answer within {timeout:.0f} s while {what}")

    def _kill(self) -> None:
        """Stop the worker and everything it started (vLLM's workers) for good, and drop its pipes
        (a restart gets fresh ones)."""
        atexit.unregister(self._kill)
        if self._process is None:
            return
        _kill_group(self._process.pid)  # also reaches children left behind by a worker that died alone
        if self._process.is_alive():
            self._process.kill()
        self._process.join(5.0)
        self._channel.close()
        self._process, self._is_loaded = None, False


def _kill_group(pgid: int) -> None:
    """SIGKILL the worker's process group: the worker and every process it started. The group id is the
    worker's pid, which Linux does not hand out again while any member of the group lives."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nobody left in the group (or it never became one)
        pass

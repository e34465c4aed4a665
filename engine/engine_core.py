"""EngineCore: the scheduler thread that drives the one model worker, and its restart policy.

The step is three calls: schedule (admit, collect frees), one round-trip on the executor, process
the outputs (detokenize, stream, finish). A failed round-trip fails the running requests with
WorkerFailed and a fresh worker is forked before the next step; waiting requests then run on it. A
worker that never loaded is not retried (a broken model would only loop). Every path that ends a
request goes through here, so each one's final output is delivered by the output side.
"""
import logging
import queue
import threading

from .errors import EngineError, ShuttingDown, WorkerFailed, describe
from .executor import ModelExecutor
from .messages import ModelInfo, StepOutput
from .output_processor import OutputProcessor, RequestObserver, RequestState
from .preprocess import PreparedRequest
from .scheduler import Scheduler, StepPlan

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = 1.0
SCHEDULE_WAIT_S = 1.0  # how long the loop blocks for work before it checks deadlines and its stop flag


class EngineCore:
    def __init__(self, scheduler: Scheduler, observer: RequestObserver | None = None):
        self.scheduler = scheduler
        self.observer = observer or RequestObserver()
        self.outputs = OutputProcessor(scheduler, self.observer)
        self.executor: ModelExecutor | None = None
        self.info: ModelInfo | None = None
        self.load_error: str | None = None
        self.first_start_done = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._has_died = False

    # -- requests ----------------------------------------------------------------------------------------

    def add(self, prepared: PreparedRequest, sink: "queue.Queue") -> None:
        self.add_states(self.outputs.new_states(prepared, sink))

    def add_states(self, states: list[RequestState]) -> None:
        """Queue a request's sequences (its samples) all or none, each with its output side."""
        self.outputs.add(states)
        try:
            self.scheduler.add_group([state.seq for state in states])
        except (EngineError, ValueError):
            self.outputs.discard(states)
            raise

    def abort(self, request_id: str) -> bool:
        found, finished = self.scheduler.abort(request_id)
        self.outputs.finish(finished)
        return found

    def schedule(self, timeout: float | None = None) -> StepPlan | None:
        """The next step's plan; what it aborted or found past its deadline gets its final output first."""
        plan = self.scheduler.schedule(timeout)
        if plan is not None:
            self.outputs.finish(list(plan.finished))
        return plan

    def process(self, output: StepOutput) -> None:
        self.outputs.process(output)

    def fail_running(self, error: EngineError) -> None:
        self.outputs.finish(self.scheduler.fail_running(error))

    def fail_all(self, error: EngineError) -> None:
        self.outputs.finish(self.scheduler.fail_all(error))

    # -- the scheduler thread ------------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        """The scheduler thread runs (or has not been started yet)."""
        return not self._has_died and (self._thread is None or self._thread.is_alive())

    def start(self, executor: ModelExecutor) -> None:
        self.executor = executor
        self._thread = threading.Thread(target=self._run_loop, name="lockstep-scheduler", daemon=True)
        self._thread.start()

    def stop(self, join_timeout: float) -> None:
        """Fail what is left, stop the worker and the thread."""
        self._stopping.set()
        self.scheduler.close()
        self.fail_all(ShuttingDown())
        if self.executor:
            self.executor.shutdown()  # kills a worker stuck in a load or a step, which frees the loop thread
        if self._thread:
            self._thread.join(join_timeout)

    def _run_loop(self) -> None:
        try:
            while not self._stopping.is_set():
                self._run_once()
        except BaseException as exc:  # noqa: BLE001 - nothing may leave callers waiting on a dead thread
            logger.critical("the scheduler thread died: %r", exc, exc_info=exc)
            self._has_died = True
            self.scheduler.close()
            self.fail_all(WorkerFailed(f"the engine's scheduler stopped ({type(exc).__name__})"))
            self.first_start_done.set()

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
        plan = self.schedule(timeout=SCHEDULE_WAIT_S)
        if plan is not None and plan.has_step:
            result = self.executor.step(plan.new_requests, plan.finished_ids)
            self.process(result.output)

    def _start_worker(self) -> bool:
        if self.info is not None:  # a restart: whatever the dead worker was computing is lost
            self.fail_running(WorkerFailed("the model worker died between steps"))
            self.observer.on_worker_restart()
        try:
            self.info = self.executor.start()
            self.load_error = None
            self.scheduler.kv_per_row = self.info.kv_per_row
            if self.info.kv_budget_tokens:  # what the worker's memory holds (a limit may have lowered it)
                self.scheduler.max_batch_kv_tokens = self.info.kv_budget_tokens
                context = self.info.max_model_len
                self.outputs.finish(self.scheduler.fail_waiting_longer_than(context, WorkerFailed(
                    f"the model worker restarted with a context of {context} tokens (what memory leaves): this "
                    "request's prompt and max_tokens no longer fit; send it again within /v1/models' max_model_len")))
            return True
        except EngineError as exc:
            self.load_error = str(exc)
            logger.error("model worker failed to start: %s", exc)
            if self.info is None:  # it never loaded: retrying a broken model would only loop
                self._stopping.set()
            self.fail_all(exc)  # nobody should wait on a worker that cannot start
            return False
        finally:
            self.first_start_done.set()

    def _on_worker_failure(self, exc: EngineError) -> None:
        """The executor has already killed the worker; the loop forks a new one before the next step."""
        logger.error("model worker failed: %s; failing running requests and restarting it", exc)
        self.fail_running(exc if isinstance(exc, WorkerFailed) else WorkerFailed(str(exc)))

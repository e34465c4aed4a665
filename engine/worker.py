"""The model worker: the forked child's entry point and its task loop.

The model is loaded here, after the fork, so the parent never touches CUDA or runs a
torch op. The loop blocks on the task queue; it exits on ShutdownTask or when the parent
is gone (so a killed server never leaves an orphan holding the model).
"""
import logging
import os
import queue
import signal

from .config import EngineConfig
from .messages import (EchoResult, EchoTask, ShutdownTask, StepResult, StepTask, Task, WorkerFailure,
                       WorkerReady)

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0


def run_worker(config: EngineConfig, model_path: str, backend_name: str, task_queue, result_queue) -> None:
    parent_pid = os.getppid()
    reset_inherited_signals()
    try:
        backend = load_backend(config, model_path, backend_name)
    except Exception as exc:  # noqa: BLE001 - any load failure must reach the parent as one clear line
        logger.exception("model worker failed to load %s", model_path)
        result_queue.put(WorkerFailure(0, f"{type(exc).__name__}: {exc}"))
        return
    result_queue.put(WorkerReady(backend.info))
    while True:
        try:
            task = task_queue.get(timeout=PARENT_CHECK_S)
        except queue.Empty:
            if os.getppid() != parent_pid:
                logger.warning("parent process is gone; model worker exits")
                return
            continue
        if isinstance(task, ShutdownTask):
            backend.close()
            return
        result_queue.put(handle_task(backend, task))


def reset_inherited_signals() -> None:
    """Drop handlers copied from the parent (gunicorn's, say): Ctrl-C is the server's to handle, not ours."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for signum in (signal.SIGTERM, signal.SIGQUIT, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)


def handle_task(backend, task: Task):
    """Run one task; a failure is reported with the task's call id and the parent restarts us."""
    try:
        match task:
            case StepTask(call_id, new_requests, finished_ids):
                return StepResult(call_id, backend.step(new_requests, finished_ids))
            case EchoTask(call_id, payload):
                return EchoResult(call_id, payload)
    except (RuntimeError, ValueError, IndexError, KeyError, TypeError, MemoryError) as exc:
        logger.exception("model worker step failed")
        return WorkerFailure(task.call_id, f"{type(exc).__name__}: {exc}")
    return WorkerFailure(task.call_id, f"unknown task {type(task).__name__}")


def load_backend(config: EngineConfig, model_path: str, backend_name: str):
    from .backends import create_backend  # the backends import torch: only ever in the child

    return create_backend(config, model_path, backend_name)

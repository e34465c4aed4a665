"""The model worker: its entry point and its task loop, in a child of the fork server (engine/fork_server.py).

The model is loaded here, so the parent never touches CUDA or runs a torch op. The worker starts from the fork
server, a fresh single-threaded Python: no lock of the engine's threads, no socket of the HTTP side and no other
engine's pipe ever reaches it, so nothing needs repairing first. It leads its own process group and dies with the
fork server, which dies with the engine's process (the fork server sets that up). The loop waits on the task pipe;
it exits on ShutdownTask or when the engine is gone (the pipe's end of file), so a killed server never leaves an
orphan holding the model.
"""
import gc
import logging
import os
import pickle
import signal

from .channel import Channel, ChannelClosed
from .errors import describe
from .memory import unmap_large_blocks_when_freed
from .messages import (EchoResult, EchoTask, ShutdownTask, StepResult, StepTask, Task, WorkerFailure,
                       WorkerReady)

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0


def run_worker(config, model_path: str, backend_name: str, channel: Channel) -> None:
    # What is loaded by now (the modules) lives as long as the worker: the collector skips it from here on, and never
    # writes to the pages the fork server still shares with us (each write would copy one).
    gc.freeze()
    parent_pid = os.getppid()  # the fork server
    ignore_stop_signals()
    unmap_large_blocks_when_freed()  # keys and values come and go: their memory must go back to the OS with them
    try:
        backend = load_backend(config, model_path, backend_name)
    except Exception as exc:  # noqa: BLE001 - any load failure must reach the parent as one clear line
        logger.exception("model worker failed to load %s", model_path)
        channel.send(WorkerFailure(0, describe(exc)), config.load_timeout_s)
        return
    try:
        channel.send(WorkerReady(backend.info), config.load_timeout_s)
        serve_tasks(backend, parent_pid, channel, result_send_s=config.step_timeout_s)
    except (TimeoutError, ChannelClosed) as exc:
        logger.warning("model worker exits: the parent no longer reads its results (%s)", exc)
    finally:
        backend.close()  # vLLM's own workers stop with it


def serve_tasks(backend, parent_pid: int, channel: Channel, result_send_s: float) -> None:
    """Answer tasks until a ShutdownTask comes or the engine is gone (the pipe's end of file; the fork server,
    `parent_pid`, gone where PR_SET_PDEATHSIG is not there to kill us). The engine reads while it waits for a result
    and gives up (kills us) `result_send_s` after its send: a result's write needs no longer bound."""
    while True:
        try:
            task = channel.receive(PARENT_CHECK_S)
        except TimeoutError:
            if os.getppid() != parent_pid:
                logger.warning("the fork server is gone; model worker exits")
                return
            continue
        except ChannelClosed as exc:  # the parent closed it, or the stream is out of step (ChannelBroken)
            logger.warning("model worker exits: its task pipe says %s", exc)
            return
        if isinstance(task, ShutdownTask):
            return
        result = handle_task(backend, task)
        try:
            channel.send(result, result_send_s)
        except (ValueError, TypeError, pickle.PicklingError) as exc:  # nothing written: say why instead
            logger.exception("model worker cannot send its result")
            channel.send(WorkerFailure(task.call_id, f"the result cannot be sent: {describe(exc)}"), result_send_s)


def ignore_stop_signals() -> None:
    """A process-group SIGTERM (systemd, `kill -- -PGID`) or Ctrl-C is for the server: it drains, then stops us
    with a ShutdownTask (or SIGKILL)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                   signal.SIGWINCH):
        signal.signal(signum, signal.SIG_IGN)


def handle_task(backend, task: Task):
    """Run one task; a failure of the whole step is reported with the task's call id and the parent
    restarts us (a failure of one request is part of the StepOutput instead)."""
    try:
        match task:
            case StepTask(call_id, new_requests, finished_ids):
                return StepResult(call_id, backend.step(new_requests, finished_ids))
            case EchoTask(call_id, payload):
                return EchoResult(call_id, payload)
    except (RuntimeError, ValueError, ArithmeticError, LookupError, TypeError, MemoryError) as exc:
        logger.exception("model worker step failed")
        return WorkerFailure(task.call_id, describe(exc))
    return WorkerFailure(task.call_id, f"unknown task {type(task).__name__}")


def load_backend(config, model_path: str, backend_name: str):
    from .backends import create_backend  # the backends import torch: only ever in the child

    return create_backend(config, model_path, backend_name)

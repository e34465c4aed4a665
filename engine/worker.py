"""The model worker: the forked child's entry point and its task loop.

The model is loaded here, after the fork, so the parent never touches CUDA or runs a
torch op. The loop waits on the task pipe; it exits on ShutdownTask or when the parent
is gone (so a killed server never leaves an orphan holding the model).

The parent runs threads (HTTP requests, the scheduler) and the fork copies only the one
that forked: whatever lock another thread held at that instant stays held in the child
forever. The first thing the child does is let go of those it will need (imports, the
standard streams' buffers).
"""
import ctypes
import gc
import io
import logging
import os
import pickle
import signal
import stat
import sys
import threading
from importlib import _bootstrap as import_machinery

from .channel import Channel, ChannelClosed, close_all_but
from .errors import describe
from .memory import unmap_large_blocks_when_freed
from .messages import (EchoResult, EchoTask, ShutdownTask, StepResult, StepTask, Task, WorkerFailure,
                       WorkerReady)

logger = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0
PR_SET_PDEATHSIG = 1
# The standard streams the fork copied, kept alive: finalizing one would flush it, and wait on its lost lock.
_inherited_streams: list = []


def run_worker(config, model_path: str, backend_name: str, channel: Channel) -> None:
    # The parent's objects are never the worker's garbage: the collector skips them, so it never writes to their pages
    # (each write copies a page the fork shared).
    gc.freeze()
    parent_pid = os.getppid()
    close_all_but(channel)  # the parent's ends, and any other engine's pipes the fork copied
    own_std_streams()
    forget_imports_of_lost_threads()
    lead_own_process_group()
    close_inherited_sockets()
    ignore_stop_signals()
    die_with_parent(parent_pid)
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
    """Answer tasks until a ShutdownTask comes or the parent is gone. The parent reads while it waits for a result
    and gives up (kills us) `result_send_s` after its send: a result's write needs no longer bound."""
    while True:
        try:
            task = channel.receive(PARENT_CHECK_S)
        except TimeoutError:
            if os.getppid() != parent_pid:
                logger.warning("parent process is gone; model worker exits")
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


def own_std_streams() -> None:
    """Give sys.stdout and sys.stderr buffers of our own, on the same files.

    A parent thread caught by the fork inside a write (its log line) holds the buffered writer's lock, which
    no one here will release: our first log line would wait on it for good. Unbuffered streams
    (PYTHONUNBUFFERED) have no such lock."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if not isinstance(getattr(stream, "buffer", None), io.BufferedWriter):
            continue
        try:
            fresh = open(stream.fileno(), "w", buffering=1 if stream.line_buffering else -1,  # noqa: SIM115
                         encoding=stream.encoding, errors=stream.errors, closefd=False)
        except (OSError, ValueError):  # not a file after all: leave it as it is
            continue
        _inherited_streams.append(stream)
        setattr(sys, name, fresh)
        _point_log_handlers(stream, fresh)


def _point_log_handlers(old, new) -> None:
    """Log handlers writing to `old` write to `new` instead (setStream would flush `old`: its lock again)."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    for handler in (h for log in loggers for h in getattr(log, "handlers", ())):
        if isinstance(handler, logging.StreamHandler) and handler.stream is old:
            handler.stream = new


def forget_imports_of_lost_threads() -> None:
    """Drop the imports other threads of the parent were in the middle of when it forked.

    Such an import holds its module's lock, and its module sits half-run in sys.modules; the thread that would
    finish it does not exist here, so importing that module in the child waited forever. Seen: the first
    request of a gunicorn worker imports `encodings.idna` (werkzeug binds the URL map to the Host header)
    while the scheduler thread forks; vLLM's import of `requests` then imports it too and hung the worker's
    start. Forgetting the lock and the half-run module lets the child import it afresh."""
    module_locks = getattr(import_machinery, "_module_locks", None)
    if module_locks is None:  # not CPython's importlib: nothing we know how to repair
        return
    me = threading.get_ident()  # the forking thread's id, kept by the child
    for name, lock in lost_thread_module_locks(module_locks, me).items():
        module_locks.pop(name, None)
        module = sys.modules.get(name)
        if getattr(getattr(module, "__spec__", None), "_initializing", False):
            del sys.modules[name]
        # Often the gunicorn worker's main thread importing wsgi (harmless here); at times encodings.idna (vLLM's hang).
        logger.info("forgot the import of %s that thread %s of the parent had not finished", name, lock.owner)
    blocking_on = getattr(import_machinery, "_blocking_on", None)
    if type(blocking_on) is dict:  # CPython 3.10/3.11; later ones keep a structure of their own here
        for thread_id in [thread_id for thread_id in blocking_on if thread_id != me]:
            del blocking_on[thread_id]  # a lost thread waiting on a lock would confuse deadlock detection


def lost_thread_module_locks(module_locks: dict, me: int) -> dict:
    """{module name: its import lock} for the locks held by a thread other than `me`."""
    held = {}
    for name, ref in list(module_locks.items()):
        lock = ref()
        if lock is not None and getattr(lock, "count", 0) and getattr(lock, "owner", me) != me:
            held[name] = lock
    return held


def lead_own_process_group() -> None:
    """Lead a process group of our own, which the processes we start (vLLM's tensor/pipeline-parallel
    workers) join: the parent kills the whole group at once, even after we died alone. It also keeps a
    process-group SIGTERM meant for the server from reaching vLLM's workers, which would stop on it."""
    try:
        os.setpgid(0, 0)
    except PermissionError:  # the parent did it already (it races us on purpose)
        pass


def ignore_stop_signals() -> None:
    """A process-group SIGTERM (systemd, `kill -- -PGID`) or Ctrl-C is for the server: it drains, then stops us
    with a ShutdownTask (or SIGKILL). Handlers copied from the parent (gunicorn's) are dropped too."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                   signal.SIGWINCH):
        signal.signal(signum, signal.SIG_IGN)


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL us when the thread that forked us (the engine's scheduler thread) ends, so not
    even a long step outlives a killed server."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the loop's parent check still ends us within a second
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(0)


def close_inherited_sockets() -> None:
    """The fork copied every socket of the HTTP side (gunicorn's listener, open client connections): close
    them, or this process keeps the port bound and half-closed clients hanging. Our channel is pipes."""
    for fd in _open_fds():
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.close(fd)  # a plain close: shutdown() would cut the connection for the parent too
        except OSError:  # already closed (the listing itself held one fd)
            continue


def _open_fds() -> list[int]:
    try:
        return [int(name) for name in os.listdir("/proc/self/fd")]
    except FileNotFoundError:
        return []


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

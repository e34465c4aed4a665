"""The fork server: a small process that forks the model worker, a fresh Python that never ran a second thread.

The engine's process runs gunicorn's threads and the scheduler thread. A fork copies only the thread that forks,
so a lock another thread held at that instant (an import's, a log line's stream buffer) stays held in the child
for good. The model worker is forked here instead: this process is started by fork+exec (subprocess, safe from
any thread), loads the standard library only (the engine package's imports start numpy's BLAS threads) and
refuses to fork if it ever has a second thread. Nothing in it needs repairing after a fork.

What every worker imports (torch, transformers, the backend: about 5 s) is imported once, by the server, before its
first fork (`preload`), so a restarted worker is ready as fast as a forked one was; numpy's BLAS is kept to one
thread there (it would otherwise start its pool at import). Where a preload still leaves the server a second
thread, it starts over as a fresh Python without one (every worker then imports for itself).

Each child starts as if the engine's process had forked it just now: that process's sys.path, sys.argv, working
directory, environment and root log handlers on stdout/stderr. It then runs a target pickled by reference (the
worker's entry point) with its end of the channel, whose two descriptors cross the server's socket (SCM_RIGHTS).
It holds no other descriptor but the standard streams: not one of the HTTP side's sockets or another engine's
pipes ever reaches this process.

Lifetimes: the server exits when the engine's end of its socket closes (the engine stopped, or its process died),
and first SIGKILLs the process group of every child still running; a child dies with the server
(PR_SET_PDEATHSIG), even in the middle of a step. Each child leads a process group of its own, which its own
children join (vLLM's workers): the engine kills it whole, and a process-group SIGTERM meant for the server does
not reach them. The server ignores such signals too: the server drains, then stops its workers and it.
"""
import atexit
import ctypes
import importlib
import json
import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import weakref

logger = logging.getLogger(__name__)

# Runs this file in a fresh interpreter as its own script, outside the engine package; the working directory, which
# `-c` puts first on sys.path, is taken off before anything is imported (a `select.py` there would be imported).
SERVER_PROGRAM = "import sys; del sys.path[0]; import runpy; runpy.run_path(sys.argv[1], run_name='__main__')"
NUM_FDS = 3  # per fork: the exit-code pipe's write end, the channel's read end and write end
MAX_REQUEST_BYTES = 1 << 20
MAX_REPLY_BYTES = 1 << 16
EXIT_CODE = struct.Struct("!q")
# A fork and its reply take milliseconds, unless the host is starved; the first waits for the server's preload.
REPLY_TIMEOUT_S = 120.0
PRELOAD_ENVIRONMENT = {"OPENBLAS_NUM_THREADS": "1"}  # numpy's BLAS: no thread pool in the server
STOP_TIMEOUT_S = 5.0
PR_SET_PDEATHSIG = 1
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
                signal.SIGWINCH)


_shared: dict[tuple[str, ...], "ForkServer"] = {}
_shared_lock = threading.Lock()


def shared_fork_server(preload: tuple[str, ...]) -> "ForkServer":
    """This process's server for `preload`, started now (its imports then overlap the engine's own start): every
    engine of the process forks its workers from it (a gunicorn worker's one, a test run's many), so the preload's
    imports are made once. It stops with the process (its socket closes: it kills what it still runs)."""
    with _shared_lock:
        server = _shared.get(preload)
        if server is None:
            server = _shared[preload] = ForkServer(preload)
            atexit.register(server.close)
    server.start()
    return server


class ForkFailed(OSError):
    """No child: the server cannot start, refused the fork, or the target cannot be pickled."""


# -- the engine's side -----------------------------------------------------------------------------------------------


class ForkServer:
    """The engine's handle on its fork server: started on the first fork (again if it died), stopped by `close`."""

    def __init__(self, preload: tuple[str, ...] = ()):
        self.preload = preload  # modules the server imports before its first fork (with the engine's sys.path)
        self._process: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self._lock = threading.Lock()  # one request and its reply at a time

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> None:
        """Start the server where it does not run (a fork starts it too)."""
        with self._lock:
            self._ensure_running()

    def start_process(self, target, args: tuple, channel) -> "ForkedProcess":
        """Fork a child that runs `target(*args, channel)` around its own copy of `channel`'s descriptors."""
        request = _fork_request(target, args, type(channel))
        with self._lock:
            self._ensure_running()
            status_read, status_write = os.pipe()
            try:
                reply = self._exchange(request, [status_write, channel.read_fd, channel.write_fd])
            except BaseException:
                os.close(status_read)
                raise
            finally:
                os.close(status_write)  # the server's copy is the one that says the exit code
        match reply:
            case ("forked", pid, num_threads):
                return ForkedProcess(pid, status_read, num_threads)
            case ("refused", reason):
                os.close(status_read)
                raise ForkFailed(f"the fork server refused: {reason}")
        os.close(status_read)
        raise ForkFailed(f"the fork server answered {reply!r}")

    def close(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop the server (it kills what it still runs); a later fork starts a new one."""
        with self._lock:
            self._stop(timeout)

    def _ensure_running(self) -> None:
        if self._process is not None and self._process.poll() is None:
            return
        self._stop(STOP_TIMEOUT_S)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            preload = json.dumps({"modules": list(self.preload), "path": sys.path}) if self.preload else ""
            self._process = subprocess.Popen(
                [sys.executable, "-c", SERVER_PROGRAM, __file__, str(theirs.fileno()), preload],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                env={**os.environ, **PRELOAD_ENVIRONMENT} if self.preload else None)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.settimeout(REPLY_TIMEOUT_S)
        self._control = ours
        logger.info("fork server %d started", self._process.pid)

    def _exchange(self, request: bytes, fds: list[int]):
        try:
            socket.send_fds(self._control, [request], fds)
            reply = self._control.recv(MAX_REPLY_BYTES)
        except OSError:
            self._stop(STOP_TIMEOUT_S)  # a late reply would be read as the next request's
            raise
        if not reply:
            self._stop(STOP_TIMEOUT_S)
            raise ForkFailed("the fork server exited")
        return pickle.loads(reply)

    def _stop(self, timeout: float) -> None:
        if self._control is not None:
            self._control.close()  # the server reads end of file, kills its children's groups and exits
            self._control = None
        if self._process is not None:
            try:
                self._process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None


class ForkedProcess:
    """A child of the fork server, as the engine sees it: its pid, and its exit code, which the server writes to a
    pipe once it has reaped it (end of file without one: the server died, and the child with it)."""

    def __init__(self, pid: int, status_fd: int, server_threads: int):
        self.pid = pid
        self.server_threads = server_threads  # the server's threads at the fork: always 1
        self.exitcode: int | None = None
        self._status_fd = status_fd
        self._has_exited = False
        self._lock = threading.Lock()
        # Closed with the object, never before: another thread may be polling it (its number could be reused).
        weakref.finalize(self, os.close, status_fd)

    def is_alive(self) -> bool:
        return not self._wait_exit(0)

    def join(self, timeout: float | None = None) -> None:
        self._wait_exit(timeout)

    def kill(self) -> None:
        if self.is_alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass

    def _wait_exit(self, timeout: float | None) -> bool:
        if self._has_exited:
            return True
        poller = select.poll()
        poller.register(self._status_fd, select.POLLIN)
        if not poller.poll(None if timeout is None else max(0, int(timeout * 1000))):
            return False
        with self._lock:
            if not self._has_exited:
                data = os.read(self._status_fd, EXIT_CODE.size)
                if len(data) == EXIT_CODE.size:
                    (self.exitcode,) = EXIT_CODE.unpack(data)
                self._has_exited = True
        return True


def _fork_request(target, args: tuple, channel_type) -> bytes:
    try:
        payload = pickle.dumps((target, args, channel_type), protocol=pickle.HIGHEST_PROTOCOL)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise ForkFailed(f"the child's entry point or arguments cannot be pickled: {exc}") from exc
    context = (list(sys.path), list(sys.argv), os.getcwd(), dict(os.environ), _log_setup())
    return pickle.dumps((context, payload), protocol=pickle.HIGHEST_PROTOCOL)


def _log_setup() -> tuple[int, list]:
    """The root logger's level, and its handlers on stdout or stderr as (fd, level, formatter)."""
    root = logging.getLogger()
    handlers = []
    for handler in root.handlers:
        try:
            fd = handler.stream.fileno() if type(handler) is logging.StreamHandler else -1
            pickle.dumps(handler.formatter)
        except (AttributeError, OSError, ValueError, TypeError, pickle.PicklingError):  # not a file, or a formatter
            continue  # that does not pickle: the child goes without it
        if fd in (1, 2):
            handlers.append((fd, handler.level, handler.formatter))
    return root.level, handlers


# -- the server ------------------------------------------------------------------------------------------------------


def serve(control_fd: int, preload: str = "") -> None:
    """Fork a child per request, send each child's exit code once it ends, exit when the engine's end closes."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    if preload:
        _preload(control_fd, json.loads(preload))
    wake_read, wake_write = os.pipe()
    for fd in (wake_read, wake_write):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, _wake)  # a handler (SIG_IGN would reap them without their exit codes)
    control = socket.socket(fileno=control_fd)
    children: dict[int, int] = {}  # pid -> the write end of its exit-code pipe
    poller = select.poll()
    poller.register(control, select.POLLIN)
    poller.register(wake_read, select.POLLIN)
    try:
        while True:
            ready = {fd for fd, _ in poller.poll()}
            if wake_read in ready:
                _drain(wake_read)
                _reap(children)
            if control_fd in ready and not _serve_request(control, children, (wake_read, wake_write)):
                return
    finally:
        for pid in children:
            _kill_group(pid)


def _preload(control_fd: int, preload: dict) -> None:
    """Import what every worker imports; where that left a second thread, start over without it."""
    path = list(sys.path)
    sys.path[:] = preload["path"]
    try:
        for module in preload["modules"]:
            importlib.import_module(module)
    except ImportError:  # the worker will say why, importing it itself
        logger.warning("the fork server could not preload %s", preload["modules"], exc_info=True)
    sys.path[:] = path
    if _count_threads() != 1:
        logger.warning("the fork server's preload of %s started a thread: its workers will import for themselves",
                       preload["modules"])
        os.execv(sys.executable, [sys.executable, "-c", SERVER_PROGRAM, __file__, str(control_fd)])


def _serve_request(control: socket.socket, children: dict[int, int], own_fds: tuple[int, ...]) -> bool:
    """Fork for one request; False at the end of the engine's socket."""
    try:
        request, fds, flags, _ = socket.recv_fds(control, MAX_REQUEST_BYTES, NUM_FDS)
    except ConnectionError:
        return False
    if not request:
        _close(fds)
        return False
    num_threads = _count_threads()
    if len(fds) != NUM_FDS or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        return _refuse(control, fds, f"a request of {len(request)} bytes with {len(fds)} descriptors")
    if num_threads != 1:  # a fork would copy one of them and whatever lock the others hold
        return _refuse(control, fds, f"the fork server has {num_threads} threads")
    status_write, *channel_fds = fds
    try:
        pid = os.fork()
    except OSError as exc:  # out of processes or memory
        return _refuse(control, fds, str(exc))
    if pid == 0:
        server_fds = [control.detach(), *own_fds, status_write, *children.values()]
        _run_child(request, channel_fds, server_fds)
    _close(channel_fds)
    _lead_group(pid)  # the child does it too: whichever runs first, its group exists before the engine learns the pid
    children[pid] = status_write
    return _reply(control, ("forked", pid, num_threads))


def _refuse(control: socket.socket, fds: list[int], reason: str) -> bool:
    _close(fds)
    return _reply(control, ("refused", reason))


def _reply(control: socket.socket, reply: tuple) -> bool:
    try:
        control.send(pickle.dumps(reply))
    except OSError:  # the engine is gone
        return False
    return True


def _reap(children: dict[int, int]) -> None:
    """Send each ended child's exit code to its engine, after killing what it left in its group (vLLM's workers):
    the group's id cannot be handed out again while the child is a zombie, so the kill reaches no one else."""
    while True:
        try:
            ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if ended is None or ended.si_pid == 0:
            return
        _kill_group(ended.si_pid)
        _, status = os.waitpid(ended.si_pid, 0)
        status_write = children.pop(ended.si_pid, None)
        if status_write is not None:
            try:
                os.write(status_write, EXIT_CODE.pack(os.waitstatus_to_exitcode(status)))
            except BrokenPipeError:  # the engine let go of it
                pass
            os.close(status_write)


# -- the child -------------------------------------------------------------------------------------------------------


def _run_child(request: bytes, channel_fds: list[int], server_fds: list[int]):
    """In the forked child: leave the server behind, then run the target. Never returns."""
    code = 1
    try:
        server_pid = os.getppid()
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _close(server_fds)
        _lead_group(0)
        _die_with_parent(server_pid)
        code = _run_request(request, channel_fds)
    except SystemExit as exc:
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - whatever the target raised, it ends here: said, and an exit code
        logger.exception("the forked child failed")
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        os._exit(code)


def _run_request(request: bytes, channel_fds: list[int]) -> int:
    context, payload = pickle.loads(request)
    sys_path, sys_argv, cwd, environ, log_setup = context
    sys.path[:], sys.argv[:] = sys_path, sys_argv
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environ)
    _log_as_the_engine(*log_setup)
    target, args, channel_type = pickle.loads(payload)  # imports the target's module: with the engine's sys.path
    for fd in channel_fds:
        os.set_inheritable(fd, False)  # never handed on to a program the child runs
    target(*args, channel_type(*channel_fds))
    return 0


def _log_as_the_engine(root_level: int, handlers: list) -> None:
    root = logging.getLogger()
    root.setLevel(root_level)
    for fd, level, formatter in handlers:
        handler = logging.StreamHandler(sys.stdout if fd == 1 else sys.stderr)
        handler.setLevel(level)
        handler.setFormatter(formatter)
        root.addHandler(handler)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL us when the server (its one thread) ends, so not even a long step outlives it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the worker's loop sees the parent gone within a second
        return
    if os.getppid() != parent_pid:  # the server died before prctl took effect
        os._exit(1)


# -- small helpers ---------------------------------------------------------------------------------------------------


def _lead_group(pid: int) -> None:
    try:
        os.setpgid(pid, pid)
    except (ProcessLookupError, PermissionError):  # the child is gone already
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # nobody left in the group
        pass


def _count_threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except FileNotFoundError:  # not Linux: the threads Python knows of
        return threading.active_count()


def _wake(signum, frame) -> None:
    """SIGCHLD's handler: the signal's byte on the wakeup pipe is what wakes the loop."""


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _close(fds) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:  # already closed
            continue


if __name__ == "__main__":
    serve(int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "")

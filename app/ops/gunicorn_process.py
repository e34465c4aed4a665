"""The real gunicorn seen from outside: start `gunicorn -c gunicorn.conf.py wsgi:app` (or find one already
running) and watch its processes, its log and its restarts.

The benchmark (bench/peers.py) and the tests (tests/harness/, the worker's start) both start lockstep with it, so it
lives in the package both import; nothing in the app imports it. It needs psutil (the test and bench extras).
Restarts show as a second "forked model worker <pid>" log line, in the restart metric, or (for a server we did not
start) as the model worker's pid changing.
"""
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

import psutil

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[2]
FORK_LINE = re.compile(r"forked model worker (\d+)")
RESTART_METRIC = re.compile(r"^lockstep:worker_restarts_total ([0-9.e+]+)$", re.MULTILINE)
READY_TIMEOUT_S = 240
READY_POLL = "GET /ready"  # the access and request log lines of our own start-up polls
PID_WATCH_INTERVAL_S = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ProcessSnapshot:
    pid: int | None
    rss_mb: float | None
    threads: int | None
    fds: int | None

    @classmethod
    def of(cls, pid: int | None) -> "ProcessSnapshot":
        try:
            process = psutil.Process(pid)
            with process.oneshot():
                return cls(pid, round(process.memory_info().rss / 2**20, 1), process.num_threads(),
                           process.num_fds())
        except (psutil.Error, ValueError, TypeError):
            return cls(pid, None, None, None)


@dataclass
class ServerSnapshot:
    http_worker: ProcessSnapshot
    model_worker: ProcessSnapshot

    def as_dict(self) -> dict:
        return {"http_worker": asdict(self.http_worker), "model_worker": asdict(self.model_worker)}


class ServerUnderTest:
    """A running lockstep server: its URL, its processes, and (if we started it) its log and process group."""

    def __init__(self, url: str, log_path: Path | None = None, process: subprocess.Popen | None = None):
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        self.host, self.port = parts.hostname, parts.port or 80
        self.ws_url = f"ws://{self.host}:{self.port}/ws"
        self.log_path = log_path
        self.process = process
        self._model_pids: set[int] = set()
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- processes --------------------------------------------------------------------------------------

    def gunicorn_master(self) -> psutil.Process | None:
        if self.process is not None:
            return psutil.Process(self.process.pid)
        return _master_listening_on(self.port)

    def http_worker_pid(self) -> int | None:
        master = self.gunicorn_master()
        children = master.children() if master else []
        return children[0].pid if children else None

    def model_worker_pid(self) -> int | None:
        pid = self.http_worker_pid()
        try:
            children = psutil.Process(pid).children() if pid else []
        except psutil.Error:
            return None
        return children[0].pid if children else None

    def snapshot(self) -> ServerSnapshot:
        return ServerSnapshot(ProcessSnapshot.of(self.http_worker_pid()), ProcessSnapshot.of(self.model_worker_pid()))

    # -- restarts -----------------------------------------------------------------------------------------

    def start_watching(self) -> None:
        """Record every model worker pid seen from now on (for servers whose log we cannot read)."""
        self._model_pids = {pid for pid in [self.model_worker_pid()] if pid}
        self._watch_stop.clear()
        self._watcher = threading.Thread(target=self._watch_model_pid, name="model-pid-watch", daemon=True)
        self._watcher.start()

    def _watch_model_pid(self) -> None:
        while not self._watch_stop.wait(PID_WATCH_INTERVAL_S):
            pid = self.model_worker_pid()
            if pid:
                self._model_pids.add(pid)

    def stop_watching(self) -> None:
        self._watch_stop.set()
        if self._watcher:
            self._watcher.join(5)

    def fork_count(self) -> int | None:
        """Model worker forks so far, from the server log (None without a log)."""
        if self.log_path is None or not self.log_path.exists():
            return None
        return len(FORK_LINE.findall(self.log_path.read_text(errors="replace")))

    def restart_metric(self) -> float | None:
        """`lockstep:worker_restarts_total` from /metrics, when the server has that counter."""
        try:
            with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
                text = response.read().decode()
        except OSError:
            return None
        match = RESTART_METRIC.search(text)
        return float(match.group(1)) if match else None

    def log_size(self) -> int:
        return self.log_path.stat().st_size if self.log_path and self.log_path.exists() else 0

    def log_tracebacks(self, since: int) -> dict:
        """Exceptions the server logged with a traceback after byte `since` of its log, by exception type:
        {type: {"count", "example"}} (a chained traceback counts each exception in the chain)."""
        if self.log_path is None or not self.log_path.exists():
            return {}
        with open(self.log_path, "rb") as log:
            log.seek(since)
            text = log.read().decode("utf-8", "replace")
        found: dict[str, dict] = {}
        for block in text.split("Traceback (most recent call last):")[1:]:
            line = _exception_line(block)
            entry = found.setdefault(line.split(":")[0], {"count": 0, "example": line})
            entry["count"] += 1
        return found

    def pids_seen(self) -> int:
        return len(self._model_pids)

    def log_tail(self, chars: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-chars:]

    # -- lifecycle ------------------------------------------------------------------------------------------

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"gunicorn exited during start-up:\n{self.log_tail()}")
            if http_status(self.url + "/ready") == 200:
                return
            self._watch_stop.wait(0.5)  # a start-up poll: nothing to block on but the port
        raise RuntimeError(f"the server at {self.url} never became ready within {timeout:.0f} s "
                           f"({self.describe_model_worker()}); its log without the readiness polls:\n"
                           f"{self.log_tail_without_polls()}")

    def describe_model_worker(self) -> str:
        """Whether the model worker is stuck or slow: its state and the CPU it used (a hung load uses none)."""
        pid = self.model_worker_pid()
        if pid is None:
            return "no model worker process"
        try:
            process = psutil.Process(pid)
            with process.oneshot():
                cpu_s, age_s, status = sum(process.cpu_times()[:2]), time.time() - process.create_time(), \
                    process.status()
        except psutil.Error:
            return f"model worker {pid} gone"
        return f"model worker {pid} {status}, {cpu_s:.1f} s of CPU in its {age_s:.0f} s"

    def log_tail_without_polls(self, chars: int = 4000) -> str:
        lines = self.log_tail(10**6).splitlines()
        return "\n".join(line for line in lines if READY_POLL not in line)[-chars:]

    def stop(self) -> None:
        """SIGTERM the whole process group we started (master, worker, model worker), then SIGKILL."""
        self.stop_watching()
        if self.process is None or self.process.poll() is not None:
            return
        signal_group(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(40)
        except subprocess.TimeoutExpired:
            signal_group(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def start_gunicorn(log_path: Path, env_overrides: dict | None = None, port: int | None = None) -> ServerUnderTest:
    """`gunicorn -c gunicorn.conf.py wsgi:app` on a free loopback port, in its own process group."""
    port = port or free_port()
    env = {**os.environ, "LOCKSTEP_HOST": "127.0.0.1", "LOCKSTEP_PORT": str(port), **(env_overrides or {})}
    gunicorn = Path(sys.executable).parent / "gunicorn"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen([str(gunicorn), "-c", "gunicorn.conf.py", "wsgi:app"], cwd=REPO, env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    logger.info("started gunicorn pid %d on port %d (log %s)", process.pid, port, log_path)
    return ServerUnderTest(f"http://127.0.0.1:{port}", log_path, process)


def _exception_line(block: str) -> str:
    """The `Type: message` line that ends a traceback block (the first unindented line after the frames)."""
    for line in block.splitlines()[1:]:
        if line and not line.startswith(" "):
            return line[:160]
    return "?"


def signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)  # start_new_session made the master its group leader
    except ProcessLookupError:
        pass


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except OSError:
        return None


def _master_listening_on(port: int) -> psutil.Process | None:
    """The gunicorn master of a server we did not start: climb from the listener on `port` (the master, its
    workers, and maybe a model worker that inherited the socket) to the topmost gunicorn process."""
    listeners = [c.pid for c in psutil.net_connections("tcp") if c.laddr and c.laddr.port == port
                 and c.status == psutil.CONN_LISTEN and c.pid]
    if not listeners:
        return None
    process = psutil.Process(listeners[0])
    while (parent := process.parent()) is not None and "gunicorn" in " ".join(parent.cmdline()):
        process = parent
    return process

"""The model worker starts from a clean process, whatever the engine's other threads are doing.

A fork copies only the thread that forks: a lock another thread held at that instant (an import's, a log stream's)
stays held in the child for good. A gunicorn worker's first request imports `encodings.idna` (werkzeug) while the
scheduler thread forked; vLLM's import of `requests` in the child then waited on that import forever (the bench's
"never became ready"). So the worker is forked by the fork server (engine/fork_server.py), a fresh single-threaded
Python, never by the engine's process. Here the worker is killed again and again under load while other threads
import and log, one of them held for the whole test in the middle of an import the worker does too; and the process
tree is what the design says: the worker a child of the fork server, which has one thread and holds nothing of the
engine's, both gone with the engine.
"""
import functools
import importlib
import itertools
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import types
import uuid
from pathlib import Path

import psutil
import pytest

from app.ops.gunicorn_process import ServerUnderTest, free_port
from engine import FinishReason, SamplingParams
from engine.channel import pipe_pair
from engine.fork_server import ForkFailed, ForkServer

from ..client import wait_until
from ..worker_faults import import_then_load, patch_worker, say_who_then_wait

REPO = Path(__file__).resolve().parents[2]
GATE_MODULE = "lockstep_test_import_gate"
# The body of a module whose import stops half-way, in the test's process only, until the test opens the gate.
SLOW_MODULE_BODY = """
import os
import sys

if os.getpid() == {test_pid}:
    gate = sys.modules["{gate}"]
    gate.import_started.set()
    gate.may_finish.wait()
VALUE = 42
"""
LONG = SamplingParams(max_tokens=200, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, ignore_eos=True)
PROMPTS = ["Tell me a story about dragons.", "1, 2, 3,"]
NUM_RESTARTS = 3
EXIT_BOUND_S = 30  # bounds a process that never ends (the failure), not how fast one does


@pytest.fixture
def module_held_mid_import(tmp_path, monkeypatch):
    """The name of a module that another thread of this process is importing, stopped half-way, until the test ends."""
    gate = types.ModuleType(GATE_MODULE)
    gate.import_started, gate.may_finish = threading.Event(), threading.Event()
    monkeypatch.setitem(sys.modules, GATE_MODULE, gate)
    name = f"slow_import_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(SLOW_MODULE_BODY.format(test_pid=os.getpid(), gate=GATE_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    importer = threading.Thread(target=importlib.import_module, args=(name,), name="held-importer", daemon=True)
    importer.start()
    assert gate.import_started.wait(60), "the importing thread never reached the module body"
    yield name
    gate.may_finish.set()
    importer.join(60)
    sys.modules.pop(name, None)


class Churn:
    """Threads that import fresh modules (written to `folder`) and log (a burst of records per import, to a file;
    every 100th to stderr too), until stopped. `wait_for_rounds` waits until each has gone round once more: they
    still run, none is stuck on a lock."""

    NUM_LOGGERS = 2
    RECORDS_PER_IMPORT = 5

    def __init__(self, folder: Path):
        self.folder = folder
        self.stopping = threading.Event()
        self.rounds = [0] * (1 + self.NUM_LOGGERS)
        self.changed = threading.Condition()
        self.log = logging.getLogger(f"tests.churn.{uuid.uuid4().hex}")
        self.log.propagate = False
        self.log.setLevel(logging.INFO)
        self.handlers = [logging.FileHandler(folder / "churn.log"), logging.StreamHandler(sys.stderr)]
        self.handlers[1].setLevel(logging.WARNING)
        for handler in self.handlers:
            self.log.addHandler(handler)
        self.threads = [threading.Thread(target=self._import, name="churn-importer", daemon=True)]
        self.threads += [threading.Thread(target=self._log, args=(i,), name=f"churn-logger-{i}", daemon=True)
                         for i in range(1, 1 + self.NUM_LOGGERS)]

    def __enter__(self) -> "Churn":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stopping.set()
        with self.changed:
            self.changed.notify_all()
        for thread in self.threads:
            thread.join(60)
        for handler in self.handlers:
            self.log.removeHandler(handler)
            handler.close()

    def wait_for_rounds(self) -> None:
        seen = list(self.rounds)
        with self.changed:
            assert self.changed.wait_for(lambda: all(a > b for a, b in zip(self.rounds, seen)), timeout=60), \
                f"a churn thread stopped going round: {seen} -> {self.rounds}"

    def _went_round(self, index: int) -> None:
        with self.changed:
            self.rounds[index] += 1
            self.changed.notify_all()

    def _import(self) -> None:
        for number in itertools.count():
            if self.stopping.is_set():
                return
            name = f"churn_{uuid.uuid4().hex}"
            (self.folder / f"{name}.py").write_text(f"import json\nNUMBER = {number}\n")
            importlib.invalidate_caches()
            assert importlib.import_module(name).NUMBER == number
            sys.modules.pop(name)
            self._went_round(0)

    def _log(self, index: int) -> None:
        for burst in itertools.count():
            with self.changed:  # a burst per import: the import's pace, not as fast as the logger can write
                self.changed.wait_for(lambda: self.rounds[0] > burst or self.stopping.is_set())
            if self.stopping.is_set():
                return
            for number in range(self.RECORDS_PER_IMPORT):
                level = logging.WARNING if number == 0 and burst % 20 == 0 else logging.INFO
                self.log.log(level, "churn logger %d, burst %d, record %d", index, burst, number)
            self._went_round(index)


def test_restarts_under_load_while_other_threads_import_and_log(make_engine, tiny_model_dir, tmp_path, monkeypatch,
                                                                 module_held_mid_import):
    # Every worker imports the module that a thread here is stuck in the middle of importing, and logs.
    patch_worker(monkeypatch, load_backend=functools.partial(import_then_load, module_held_mid_import))
    engine = make_engine(tiny_model_dir)
    fork_server = psutil.Process(engine.executor.fork_server_pid)
    pids = [engine.executor.pid]
    with Churn(tmp_path) as churn:
        for _ in range(NUM_RESTARTS):
            running = [engine.submit(prompt, LONG) for prompt in PROMPTS]
            for handle in running:
                next(iter(handle))  # decoding
            churn.wait_for_rounds()
            os.kill(pids[-1], signal.SIGKILL)
            for handle in running:
                assert handle.result(timeout=60).error_code == "worker_failed"
            after = engine.generate(["Hi"], SHORT, timeout=300)[0]  # waits for the new worker
            assert after.finish_reason is FinishReason.LENGTH and after.usage.completion_tokens == 4
            pids.append(engine.executor.pid)
            worker = psutil.Process(pids[-1])
            assert worker.ppid() == fork_server.pid and fork_server.ppid() == os.getpid()
            assert engine.executor.fork_server_pid == fork_server.pid  # the same server forked every one
            assert engine.executor._process.server_threads == 1
            assert engine.info.model.endswith("#42")  # the worker ran the held module's body to its end itself
            churn.wait_for_rounds()
    assert len(set(pids)) == NUM_RESTARTS + 1
    assert "VALUE" not in vars(sys.modules[module_held_mid_import])  # the import here is still held


def fds_of(pid: int) -> dict[int, str]:
    folder = f"/proc/{pid}/fd"
    links = {}
    for name in os.listdir(folder):
        try:
            links[int(name)] = os.readlink(f"{folder}/{name}")
        except FileNotFoundError:  # closed meanwhile
            continue
    return links


def wait_gone(processes: list[psutil.Process]) -> None:
    """Until every one has exited (a zombie has: its parent may be a PID 1 that does not reap)."""
    wait_until(lambda: not [p for p in processes if is_running(p)], timeout=EXIT_BOUND_S, what="every process gone")


def is_running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def pipe_of(fd: int) -> str:
    return f"pipe:[{os.fstat(fd).st_ino}]"


def test_the_worker_is_the_fork_servers_child_and_holds_nothing_of_the_engines(make_engine, tiny_model_dir):
    listener = socket.create_server(("127.0.0.1", 0))  # what gunicorn's listener is to a real server
    other_engine, other_worker = pipe_pair()  # what another engine's pipes are
    try:
        engine = make_engine(tiny_model_dir)
        executor = engine.executor
        worker, fork_server = psutil.Process(executor.pid), psutil.Process(executor.fork_server_pid)
        assert worker.ppid() == fork_server.pid != os.getpid() and fork_server.ppid() == os.getpid()
        assert os.getpgid(worker.pid) == worker.pid != os.getpgid(0)  # a group of its own
        assert os.getpgid(fork_server.pid) == os.getpgid(0)  # and the server in the engine's
        assert fork_server.num_threads() == 1 and executor._process.server_threads == 1

        worker_fds = set(fds_of(worker.pid).values())
        own_pipes = {pipe_of(fd) for fd in (executor._channel.read_fd, executor._channel.write_fd)}
        others = {pipe_of(fd) for channel in (other_engine, other_worker) for fd in (channel.read_fd, channel.write_fd)}
        assert own_pipes <= worker_fds and not others & worker_fds
        assert not [link for link in worker_fds if link.startswith("socket:")]
        server_fds = fds_of(fork_server.pid)
        assert len([link for link in server_fds.values() if link.startswith("socket:")]) == 1  # its own, to us
        assert not (own_pipes | others) & set(server_fds.values())
        assert engine.generate(["Hi"], SHORT)[0].finish_reason is FinishReason.LENGTH
    finally:
        listener.close()
        other_engine.close()
        other_worker.close()


def kill_while_decoding(engine, kill) -> None:
    """`kill()` while the worker decodes a request, which then fails with worker_failed."""
    handle = engine.submit(PROMPTS[0], LONG)
    next(iter(handle))
    kill()
    assert handle.result(timeout=60).error_code == "worker_failed"


def test_the_fork_server_ignores_stop_signals_and_is_replaced_if_it_dies(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    first_server = psutil.Process(engine.executor.fork_server_pid)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # a process-group signal for the HTTP side
        first_server.send_signal(signum)
    kill_while_decoding(engine, psutil.Process(engine.executor.pid).kill)
    assert engine.generate(["Hi"], SHORT, timeout=300)[0].finish_reason is FinishReason.LENGTH
    assert engine.executor.fork_server_pid == first_server.pid  # it took the signals and forked again

    kill_while_decoding(engine, first_server.kill)  # its worker goes with it
    assert engine.generate(["Hi"], SHORT, timeout=300)[0].finish_reason is FinishReason.LENGTH
    assert engine.executor.fork_server_pid not in (None, first_server.pid)  # a new server forked the new worker


ENGINE_SCRIPT = textwrap.dedent("""
    import sys, threading
    from engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=sys.argv[1], dtype="float32", threads=1)).start()
    engine.generate(["Hello"], SamplingParams(max_tokens=2))
    print("PIDS", engine.executor.fork_server_pid, engine.executor.pid, flush=True)
    threading.Event().wait()
""")


def test_the_worker_goes_with_its_engine_and_the_fork_server_with_the_process(make_engine, tiny_model_dir):
    """The process's one fork server outlives an engine (the next forks from it, its imports made once); its
    workers and it go with the process, even killed."""
    engine = make_engine(tiny_model_dir)
    server, worker = psutil.Process(engine.executor.fork_server_pid), psutil.Process(engine.executor.pid)
    engine.shutdown()
    wait_gone([worker])
    assert server.is_running() and server.num_threads() == 1
    assert make_engine(tiny_model_dir).executor.fork_server_pid == server.pid

    parent = subprocess.Popen([sys.executable, "-c", ENGINE_SCRIPT, tiny_model_dir], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = next((line for line in parent.stdout if line.startswith("PIDS ")), "")
        processes = [psutil.Process(int(pid)) for pid in line.split()[1:]]
        assert len(processes) == 2, "the engine's process did not start its worker"
        parent.kill()  # no shutdown, no atexit: only the kernel and the pipes are left to end them
        parent.wait(EXIT_BOUND_S)
        wait_gone(processes)
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.stdout.close()


# -- the fork server alone, with a child that loads no model ---------------------------------------------------------


@pytest.fixture
def fork_server():
    server = ForkServer()
    yield server
    server.close()


def fork_child(server: ForkServer):
    """A child that says (pid, parent pid, descriptors) and waits for its exit code: (process, our end, its words)."""
    ours, theirs = pipe_pair()
    try:
        process = server.start_process(say_who_then_wait, (), theirs)
    finally:
        theirs.close()
    return process, ours, ours.receive(60)


def test_a_child_of_the_fork_server_holds_only_its_channel_and_reports_its_exit(fork_server):
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        process, channel, (pid, parent_pid, fds) = fork_child(fork_server)
    finally:
        listener.close()
    assert (pid, parent_pid) == (process.pid, fork_server.pid) and process.server_threads == 1
    assert psutil.Process(fork_server.pid).num_threads() == 1
    assert len(fds) == 5 and {0, 1, 2} < set(fds)  # the standard streams and its channel's two ends: nothing else
    assert os.getpgid(pid) == pid
    channel.send(3, 10)
    process.join(EXIT_BOUND_S)
    assert (process.is_alive(), process.exitcode) == (False, 3)
    channel.close()

    process, channel, _ = fork_child(fork_server)
    process.kill()
    process.join(EXIT_BOUND_S)
    assert process.exitcode == -signal.SIGKILL
    channel.close()


def test_a_child_dies_with_the_fork_server_even_stopped(fork_server):
    process, channel, _ = fork_child(fork_server)
    child, first_server = psutil.Process(process.pid), fork_server.pid
    child.suspend()  # as a worker deep in a long step: it reads no pipe
    psutil.Process(first_server).kill()  # the server cannot kill it itself: PR_SET_PDEATHSIG must
    wait_gone([child])
    process.join(EXIT_BOUND_S)
    assert not process.is_alive() and process.exitcode is None  # no server left to say how it ended
    channel.close()

    process, channel, (_, parent_pid, _) = fork_child(fork_server)  # the next fork starts a new server
    assert parent_pid == fork_server.pid != first_server
    child = psutil.Process(process.pid)
    fork_server.close()  # the server ends its children first
    wait_gone([child])
    channel.close()


def test_a_target_that_does_not_pickle_is_refused_before_a_fork(fork_server):
    ours, theirs = pipe_pair()
    with pytest.raises(ForkFailed, match="cannot be pickled"):
        fork_server.start_process(lambda channel: None, (), theirs)
    assert fork_server.pid is None  # refused before the server was needed
    ours.close()
    theirs.close()


def test_the_bench_says_what_a_server_that_never_became_ready_was_doing(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("INFO engine.executor: forked model worker 4242 for the model\n"
                   + '127.0.0.1 [30/Nov/2026:10:25:16 +0000] "GET /ready HTTP/1.1" 503 76 25353us\n' * 500
                   + "ERROR engine.engine_core: model worker failed to start: the model worker did not answer within "
                     "240 s while loading the model\n")
    server = ServerUnderTest(f"http://127.0.0.1:{free_port()}", log)  # nothing listens there: never ready

    with pytest.raises(RuntimeError) as raised:
        server.wait_ready(timeout=1)
    first_line, *log_lines = str(raised.value).splitlines()
    assert first_line.startswith(f"the server at {server.url} never became ready within 1 s (no model worker")
    assert "GET /ready" not in str(raised.value)
    assert log_lines[-2:] == ["INFO engine.executor: forked model worker 4242 for the model",
                              "ERROR engine.engine_core: model worker failed to start: the model worker did not answer "
                              "within 240 s while loading the model"]

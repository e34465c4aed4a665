"""The model worker starts whatever the parent's other threads were doing at the instant of the fork.

The fork copies only the forking thread: a lock another thread held then stays held in the child for good. A
gunicorn worker's first request imports `encodings.idna` (werkzeug) while the scheduler thread forks; vLLM's
import of `requests` in the child then waited on that import forever (the bench's "never became ready").
Here a thread is held, for as long as the test needs, in the middle of an import (or of a write to stderr) that
the worker also does while loading (injected into load_backend, which the fork inherits), so the fork always
lands inside it.
"""
import dataclasses
import importlib
import io
import multiprocessing.util
import os
import select
import sys
import threading
import types
import uuid

import pytest

from bench.server import ServerUnderTest, free_port
from engine import EngineConfig
from engine import worker as worker_module
from engine.executor import ModelExecutor

GATE_MODULE = "lockstep_test_import_gate"
# The body of a module whose import, in the test's process only, stops half-way until the test opens the gate.
SLOW_MODULE_BODY = f"""
import os

import {GATE_MODULE} as gate

if os.getpid() == gate.test_pid:
    gate.import_started.set()
    gate.may_finish.wait()
VALUE = 42
"""
LOAD_BOUND_S = 120  # bounds a hang of the worker's load (the failure this test guards against), not its speed


@pytest.fixture
def module_held_mid_import(tmp_path, monkeypatch):
    """The name of a module that another thread is importing, stopped half-way, until the test ends."""
    gate = types.ModuleType(GATE_MODULE)
    gate.import_started, gate.may_finish = threading.Event(), threading.Event()
    gate.test_pid = os.getpid()
    monkeypatch.setitem(sys.modules, GATE_MODULE, gate)
    name = f"slow_import_{uuid.uuid4().hex}"
    (tmp_path / f"{name}.py").write_text(SLOW_MODULE_BODY)
    monkeypatch.syspath_prepend(str(tmp_path))
    importer = threading.Thread(target=importlib.import_module, args=(name,), name="held-importer", daemon=True)
    importer.start()
    assert gate.import_started.wait(60), "the importing thread never reached the module body"
    yield name
    gate.may_finish.set()
    importer.join(60)
    sys.modules.pop(name, None)


def test_worker_loads_although_another_thread_was_importing_at_fork(module_held_mid_import, tiny_model_dir,
                                                                      monkeypatch):
    real_load_backend = worker_module.load_backend

    def load_importing_the_held_module(config, model_path, backend_name):
        # The child imports the module the parent's other thread is still importing, as vLLM's import of
        # `requests` imports `encodings.idna`; what the module set travels back in the model's name.
        value = importlib.import_module(module_held_mid_import).VALUE
        backend = real_load_backend(config, model_path, backend_name)
        backend.info = dataclasses.replace(backend.info, model=f"{model_path}#{value}")
        return backend

    monkeypatch.setattr(worker_module, "load_backend", load_importing_the_held_module)  # inherited by the fork
    config = EngineConfig(model=tiny_model_dir, dtype="float32", threads=1, load_timeout_s=LOAD_BOUND_S)
    executor = ModelExecutor(config, tiny_model_dir, "hf")
    try:
        info = executor.start()
        assert executor.echo("still answering") == "still answering"
    finally:
        executor.shutdown()
    assert info.model == f"{tiny_model_dir}#42"  # the child ran the module's body to the end itself
    assert "VALUE" not in vars(sys.modules[module_held_mid_import])  # the parent's import is still held


def test_locks_of_other_threads_are_found_and_the_forking_threads_are_kept():
    class Lock:
        def __init__(self, owner, count):
            self.owner, self.count = owner, count

    me = threading.get_ident()
    locks = {"lost": Lock(me + 1, 1), "mine": Lock(me, 1), "free": Lock(None, 0)}
    refs = {name: (lambda lock=lock: lock) for name, lock in locks.items()}
    assert worker_module.lost_thread_module_locks(refs, me) == {"lost": locks["lost"]}


class HeldStderr:
    """sys.stderr is a buffered pipe whose buffer lock a thread holds, stuck in write(2) on the full pipe, until
    `drain()` (called after the fork) starts reading it; `everything_written()` is all that came through."""

    def __init__(self):
        self.read_fd, write_fd = os.pipe()
        self.stream = io.TextIOWrapper(io.BufferedWriter(io.FileIO(write_fd, "w")), encoding="utf-8",
                                       line_buffering=True)
        self.writer = threading.Thread(target=self.stream.write, args=("x" * 2**20 + "\n",), name="held-writer",
                                       daemon=True)
        self.received = bytearray()
        self.reader = threading.Thread(target=self._read_to_the_end, name="stderr-reader", daemon=True)

    def hold(self) -> None:
        self.writer.start()
        while select.select([], [self.stream.fileno()], [], 0)[1]:
            self.writer.join(0.05)  # it fills the pipe, then blocks in write(2) holding the buffer's lock

    def drain(self) -> None:
        self.reader.start()

    def everything_written(self) -> bytes:
        """Once every writer is done (the worker has exited): the writer thread's, then the end of file."""
        self.writer.join(60)
        self.stream.close()
        self.reader.join(60)
        return bytes(self.received)

    def _read_to_the_end(self) -> None:
        while chunk := os.read(self.read_fd, 2**16):
            self.received.extend(chunk)
        os.close(self.read_fd)


@pytest.fixture
def held_stderr():
    held = HeldStderr()
    yield held
    if held.reader.ident is None:  # the test failed before the fork
        held.drain()
    held.everything_written()


def test_worker_loads_although_another_thread_was_writing_to_stderr_at_fork(held_stderr, tiny_model_dir,
                                                                              monkeypatch):
    monkeypatch.setattr(sys, "stderr", held_stderr.stream)  # here: pytest's capture sets its own per phase
    # multiprocessing flushes stderr just before the fork, which waits for the writer; the writer taking the lock
    # again between that flush and the fork is the race: skipping the flush puts the fork right there.
    monkeypatch.setattr(multiprocessing.util, "_flush_std_streams", lambda: None)
    held_stderr.hold()
    real_load_backend = worker_module.load_backend

    def load_writing_to_stderr(config, model_path, backend_name):
        print("model worker writes to stderr", file=sys.stderr, flush=True)  # as a log handler on stderr does
        return real_load_backend(config, model_path, backend_name)

    monkeypatch.setattr(worker_module, "load_backend", load_writing_to_stderr)  # inherited by the fork
    config = EngineConfig(model=tiny_model_dir, dtype="float32", threads=1, load_timeout_s=LOAD_BOUND_S)
    executor = ModelExecutor(config, tiny_model_dir, "hf")
    fork_worker = executor._fork_worker

    def fork_then_drain(worker_end):
        process = fork_worker(worker_end)
        held_stderr.drain()  # the fork landed inside the write: now let every writer go on
        return process

    monkeypatch.setattr(executor, "_fork_worker", fork_then_drain)
    try:
        executor.start()
        assert executor.echo("still answering") == "still answering"
    finally:
        executor.shutdown()
    assert b"model worker writes to stderr\n" in held_stderr.everything_written()


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

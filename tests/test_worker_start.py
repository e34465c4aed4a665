"""The model worker starts whatever the parent's other threads were doing at the instant of the fork.

The fork copies only the forking thread: a lock another thread held then stays held in the child for good. A
gunicorn worker's first request imports `encodings.idna` (werkzeug) while the scheduler thread forks; vLLM's
import of `requests` in the child then waited on that import forever (the bench's "never became ready").
Here a thread is held, for as long as the test needs, in the middle of importing a module the worker imports
while loading (injected into load_backend, which the fork inherits), so the fork always lands inside it.
"""
import dataclasses
import importlib
import os
import sys
import threading
import types
import uuid

import pytest

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

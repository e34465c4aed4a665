"""Faults injected into the model worker itself.

The worker is forked by the fork server, a fresh Python: a monkeypatch in the test's process never reaches it. So
`patch_worker` makes the engine's next worker run `run_patched_worker`, which makes the replacements in the worker
before it starts. Each replacement is a module-level function of this module (it crosses by pickle, by name), or a
functools.partial of one; gates are files, the only thing the test's process and the worker share.
"""
import dataclasses
import fcntl
import functools
import importlib
import logging
import os
import sys

from engine import executor as executor_module
from engine import worker
from engine.channel import ChannelClosed
from engine.messages import EchoResult, EchoTask, StepTask

POISON_SEED = 666
REAL = {}  # target -> the original it replaced, in the worker


def patch_worker(monkeypatch, **replacements) -> None:
    """The engine's workers forked from now on run with `replacements[target]` in place of each target: one of
    engine.worker's functions by its name, or "sample" (TokenSampler.__call__)."""
    monkeypatch.setattr(executor_module, "run_worker", functools.partial(run_patched_worker, replacements))


def run_patched_worker(replacements: dict, *args) -> None:
    for target, replacement in replacements.items():
        owner, name = _owner(target)
        REAL[target] = getattr(owner, name)
        setattr(owner, name, replacement)
    worker.run_worker(*args)


def _owner(target: str):
    if target == "sample":
        from engine.backends.sampler import TokenSampler  # torch: in the worker only

        return TokenSampler, "__call__"
    return worker, target


def lying_handle_task(backend, task):
    """An echo of "lie" answers another call's id."""
    if isinstance(task, EchoTask) and task.payload == "lie":
        return EchoResult(task.call_id + 1000, task.payload)
    return REAL["handle_task"](backend, task)


def slow_handle_task(gate: str, backend, task):
    """A step waits while the test holds the gate."""
    if isinstance(task, StepTask):
        FileGate(gate).pass_through()
    return REAL["handle_task"](backend, task)


def load_after_gate(gate: str, *args):
    """The model loads once the test opens the gate."""
    FileGate(gate).pass_through()
    return REAL["load_backend"](*args)


def poisoned_sample(self, logits):
    if self.sampling.seed == POISON_SEED:
        raise RuntimeError("probability tensor contains nan")
    return REAL["sample"](self, logits)


def import_then_load(module_name: str, *args):
    """The worker imports `module_name` (which the test's process may be importing at that moment) and logs, then
    loads; what the module set travels back in the model's name."""
    value = importlib.import_module(module_name).VALUE
    logging.getLogger(__name__).warning("model worker %d imported %s", os.getpid(), module_name)
    backend = REAL["load_backend"](*args)
    backend.info = dataclasses.replace(backend.info, model=f"{backend.info.model}#{value}")
    return backend


def say_who_then_wait(channel) -> None:
    """A child of the fork server that says who it is and which descriptors it holds, then waits for the word to
    exit (or the end of its pipe)."""
    listed = [int(fd) for fd in os.listdir("/proc/self/fd")]
    fds = [fd for fd in listed if os.path.exists(f"/proc/self/fd/{fd}")]  # not the listing's own, closed by now
    channel.send((os.getpid(), os.getppid(), fds), 30)
    try:
        sys.exit(channel.receive(600))
    except ChannelClosed:
        return


class FileGate:
    """A gate two processes share through a file lock: shut while the test holds the lock, open once it releases it
    (or its process ends). Passing waits on the lock, never on a clock."""

    def __init__(self, path: str):
        self.path = path
        self._held = None

    def hold(self) -> None:
        self._held = open(self.path, "a")  # noqa: SIM115 - kept open (and locked) until `release`
        fcntl.flock(self._held, fcntl.LOCK_EX)

    def release(self) -> None:
        if self._held is not None:
            self._held.close()  # the lock goes with it
            self._held = None

    def pass_through(self) -> None:
        with open(self.path, "a") as file:
            fcntl.flock(file, fcntl.LOCK_SH)

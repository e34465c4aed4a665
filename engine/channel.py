"""The pipes between the engine and its model worker: whole pickled messages, each read and write bounded.

multiprocessing's Queue gives every message to a feeder thread that writes it, so each message waits for one more
thread to wake (docs/benchmarks.md, "Measurements behind the code's constants"). Here the sending thread writes the
message itself. The file descriptors are non-blocking and every wait is a `poll` with a deadline: a
peer that stopped (SIGSTOP, a hung step) mid-message cannot hold the other side, and a message larger than the
pipe (a long prompt) is written as the reader takes it. A send cut off mid-message (a timeout, an exception
between writes) leaves the stream out of step: the channel is then broken, and the caller drops it (the executor
kills the worker and makes fresh pipes).
"""
import io
import os
import pickle
import select
import struct
import time
from dataclasses import dataclass, field

HEADER = struct.Struct("!Q")  # the pickle's length
MAX_MESSAGE_BYTES = 1 << 31  # larger means a desynchronized stream, not a message
READ_CHUNK = 1 << 16  # a pipe's buffer: os.read allocates what it is asked for


class ChannelClosed(EOFError):
    """The other end is gone (its process exited or closed it), or this end was closed."""


class ChannelBroken(ChannelClosed):
    """The stream is out of step (a message cut off, a header no message has, a pickle that does not load): no
    later message can be trusted."""


def pipe_pair() -> tuple["Channel", "Channel"]:
    """Two ends that talk to each other: one for the engine, one that the fork server hands to the worker it forks.
    The descriptors are not inherited by programs this process runs (the fork server among them)."""
    fds: list[int] = []
    try:
        fds += os.pipe()  # to the child: read, write
        fds += os.pipe()  # to the parent: read, write
        for fd in fds:
            os.set_blocking(fd, False)
    except OSError:
        _close(fds)
        raise
    to_child_read, to_child_write, to_parent_read, to_parent_write = fds
    return Channel(to_parent_read, to_child_write), Channel(to_child_read, to_parent_write)


@dataclass(eq=False)
class Channel:
    """One end: the descriptors it reads and writes. Each process holds only its own end (the engine closes the
    worker's once the fork server has passed it on), so either's exit reads as EOF at the other."""
    read_fd: int
    write_fd: int
    _received: bytearray = field(default_factory=bytearray, repr=False)
    _broken: str = ""

    def send(self, message, timeout: float) -> None:
        """Write one message; TimeoutError if the reader took too little of it within `timeout` (the channel is
        then broken), ChannelClosed if the reader is gone, ValueError (nothing written) if it is too large."""
        self._check_usable()
        view = frame = _frame(message)
        deadline = time.monotonic() + timeout
        try:
            while view:
                try:
                    view = view[os.write(self.write_fd, view):]
                except BlockingIOError:
                    self._wait(self.write_fd, select.POLLOUT, deadline)
                except BrokenPipeError:
                    raise ChannelClosed("the other end of the pipe is gone") from None
                except OSError as exc:
                    raise ChannelClosed(f"the pipe cannot be written: {exc}") from None
        finally:
            if 0 < len(view) < len(frame):
                self._broken = "a message was cut off mid-write"

    def receive(self, timeout: float):
        """The next message; TimeoutError if it has not fully come within `timeout` (what came is kept for the
        next call), ChannelClosed if the writer is gone, ChannelBroken if the stream is out of step."""
        self._check_usable()
        deadline = time.monotonic() + timeout
        while (message := self._complete_message()) is None:
            try:
                chunk = os.read(self.read_fd, READ_CHUNK)
            except BlockingIOError:
                self._wait(self.read_fd, select.POLLIN, deadline)
                continue
            except OSError as exc:  # closed under us (the interpreter's exit hook kills the worker)
                raise ChannelClosed(f"the pipe cannot be read: {exc}") from None
            if not chunk:
                raise ChannelClosed("the other end of the pipe is gone")
            self._received += chunk
        return message

    def close(self) -> None:
        _close((self.read_fd, self.write_fd))
        self.read_fd = self.write_fd = -1  # never closed twice: the numbers may belong to another file by then

    def _check_usable(self) -> None:
        if self._broken:
            raise ChannelBroken(self._broken)
        if self.read_fd < 0:
            raise ChannelClosed("this end of the pipe is closed")

    def _complete_message(self):
        if len(self._received) < HEADER.size:
            return None
        (size,) = HEADER.unpack_from(self._received)
        if size > MAX_MESSAGE_BYTES:
            self._broken = f"a message header of {size} bytes: the stream is out of step"
            raise ChannelBroken(self._broken)
        end = HEADER.size + size
        if len(self._received) < end:
            return None
        try:
            with memoryview(self._received) as received, received[HEADER.size:end] as pickled:
                return pickle.loads(pickled)
        except Exception as exc:  # noqa: BLE001 - whatever a pickle raises, the message is lost: say so
            self._broken = f"a message that does not load: {exc!r}"
            raise ChannelBroken(self._broken) from exc
        finally:
            del self._received[:end]

    @staticmethod
    def _wait(fd: int, event: int, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the pipe's other end did not keep up")
        poller = select.poll()
        poller.register(fd, event)
        poller.poll(max(1, int(remaining * 1000 + 0.999)))  # ms, rounded up: never a busy zero-wait loop


def _frame(message) -> memoryview:
    """The header and the pickle in one buffer, written by one pickler (no copy of a large message)."""
    buffer = io.BytesIO()
    buffer.write(bytes(HEADER.size))
    pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    size = buffer.tell() - HEADER.size
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"a message of {size} bytes is larger than the channel takes ({MAX_MESSAGE_BYTES})")
    frame = buffer.getbuffer()
    HEADER.pack_into(frame, 0, size)
    return frame


def _close(fds) -> None:
    for fd in fds:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:  # already closed
                continue

"""The pipes between the engine and its model worker: whole pickled messages, each read and write bounded.

multiprocessing's Queue gives every message to a feeder thread that writes it, so each message waits for one more
thread to wake; on a 2-core host that was ~0.3 ms a decode step beside a ~10 ms step. Here the sending thread
writes the message itself. The file descriptors are non-blocking and every wait is a `poll` with a deadline: a
peer that stopped (SIGSTOP, a hung step) mid-message cannot hold the other side, and a message larger than the
pipe (a long prompt) is written as the reader takes it. A timeout leaves the stream mid-message, so the caller
drops the channel then (the executor kills the worker and makes fresh pipes).
"""
import os
import pickle
import select
import struct
import time
from dataclasses import dataclass, field

HEADER = struct.Struct("!Q")  # the pickle's length
MAX_MESSAGE_BYTES = 1 << 31  # larger means a desynchronized stream, not a message
READ_CHUNK = 1 << 20


class ChannelClosed(EOFError):
    """The other end is gone (its process exited or closed it)."""


def pipe_pair() -> tuple["Channel", "Channel"]:
    """Two ends that talk to each other: one for the parent, one for the child it forks."""
    to_child_read, to_child_write = os.pipe()
    to_parent_read, to_parent_write = os.pipe()
    parent = Channel(to_parent_read, to_child_write, peer_fds=(to_child_read, to_parent_write))
    child = Channel(to_child_read, to_parent_write, peer_fds=(to_parent_read, to_child_write))
    for fd in (to_child_read, to_child_write, to_parent_read, to_parent_write):
        os.set_blocking(fd, False)
    return parent, child


@dataclass
class Channel:
    read_fd: int
    write_fd: int
    peer_fds: tuple[int, ...] = ()  # the other end's, closed by `close_peer` once the child has them
    _received: bytearray = field(default_factory=bytearray)

    def send(self, message, timeout: float) -> None:
        """Write one message; TimeoutError if the reader took too little of it within `timeout` (the stream is
        then mid-message: drop the channel), ChannelClosed if the reader is gone."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        view = memoryview(HEADER.pack(len(data)) + data)
        deadline = time.monotonic() + timeout
        while view:
            try:
                view = view[os.write(self.write_fd, view):]
            except BlockingIOError:
                self._wait(self.write_fd, select.POLLOUT, deadline)
            except BrokenPipeError:
                raise ChannelClosed("the other end of the pipe is gone") from None

    def receive(self, timeout: float):
        """The next message; TimeoutError if it has not fully come within `timeout` (what came is kept for the
        next call), ChannelClosed if the writer is gone."""
        deadline = time.monotonic() + timeout
        while (message := self._complete_message()) is None:
            try:
                chunk = os.read(self.read_fd, READ_CHUNK)
            except BlockingIOError:
                self._wait(self.read_fd, select.POLLIN, deadline)
                continue
            if not chunk:
                raise ChannelClosed("the other end of the pipe is gone")
            self._received += chunk
        return message

    def close_peer(self) -> None:
        """Close the other end's descriptors in this process (after the fork), so that end's exit reads as EOF."""
        _close(self.peer_fds)
        self.peer_fds = ()

    def close(self) -> None:
        _close((self.read_fd, self.write_fd, *self.peer_fds))
        self.read_fd = self.write_fd = -1
        self.peer_fds = ()

    def _complete_message(self):
        if len(self._received) < HEADER.size:
            return None
        (size,) = HEADER.unpack_from(self._received)
        if size > MAX_MESSAGE_BYTES:
            raise ChannelClosed(f"a message header of {size} bytes: the stream is out of step")
        end = HEADER.size + size
        if len(self._received) < end:
            return None
        message = pickle.loads(self._received[HEADER.size:end])
        del self._received[:end]
        return message

    @staticmethod
    def _wait(fd: int, event: int, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the pipe's other end did not keep up")
        poller = select.poll()
        poller.register(fd, event)
        poller.poll(max(1, int(remaining * 1000 + 0.999)))  # ms, rounded up: never a busy zero-wait loop


def _close(fds) -> None:
    for fd in fds:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:  # already closed
                continue

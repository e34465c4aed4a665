"""A session's socket: sending its frames, closing it with a code, and the guard on the connection below it.

Every WebSocket route (app/sockets/ws.py, app/responses/ws.py) speaks through one SocketTransport. Once the client is
gone, or a close frame went out, a send does nothing and `is_open` turns false: the session loop ends there.
"""
import json
import select
import socket
import ssl
import threading
import time

from simple_websocket import ConnectionClosed, Server
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError

CLOSE_WAIT_S = 2.0  # how long a closing socket waits for the client's close reply, and drains what it still sends
# A client that has read nothing for this long while frames wait is cut off: it would hold the session's thread
# (and a drain past gunicorn's graceful timeout), and what the engine sends it would pile up in memory.
SEND_TIMEOUT_S = 8.0
MAX_DRAIN_BYTES = 4 << 20
RECEIVE_CHECK_S = 1.0  # how often a waiting receive looks whether the connection has gone
SEND_ERRORS = (ConnectionClosed, OSError, LocalProtocolError)  # the client is gone, or the socket is closing


class SocketTransport:
    """simple_websocket's Server as a session uses it: JSON frames out, client frames in, one close."""

    def __init__(self, ws: Server):
        self.ws = ws
        self.is_open = True

    def send(self, frame: dict) -> None:
        self.send_text(json.dumps(frame))

    def send_text(self, text: str) -> None:
        if not self.is_open:
            return
        try:
            self.ws.send(text)
        except SEND_ERRORS:  # the client is gone (BrokenPipe, reset), or the socket is already closing (a close
            self.is_open = False  # code was sent): end the session

    def receive(self) -> str | bytes | None:
        """The client's next frame; None once the socket has closed (ConnectionClosed may be raised instead).

        Waits in slices: upstream wakes a waiting receive for a too-big message (1009) before it marks itself
        disconnected, so a receive without a timeout could miss the close and hold the session for good."""
        while True:
            data = self.ws.receive(timeout=RECEIVE_CHECK_S)
            if data is not None or not self.ws.connected:
                return data

    def mark_closed(self) -> None:
        self.is_open = False

    def close(self, code: int, reason: str) -> None:
        """Send a close frame unless one went already. Wakes a `receive` that waits: upstream leaves it blocked
        once it has sent its close frame, until the client answers."""
        if not self.ws.connected:
            return
        try:
            self.ws.close(code, reason)
        except SEND_ERRORS:  # closing or closed already
            pass
        finally:
            self.ws.event.set()

    def finish(self) -> None:
        """Wait for the client's close reply (bounded), then let the socket's thread close the connection."""
        self.close(CloseReason.NORMAL_CLOSURE, "")
        self.ws.thread.join(CLOSE_WAIT_S)
        if self.ws.thread.is_alive():  # the client never answered the close: cut the connection
            self.ws.sock.shutdown_quietly()
            self.ws.thread.join(CLOSE_WAIT_S)


class GuardedSocket:
    """The connection's socket as simple_websocket uses it (send, recv, fileno, close), adapted:

    - one lock around sends (the ping thread and the session both send) and `sendall`, not `send`;
    - a lingering close, so a client still sending (a 1 MiB frame past the 256 KiB limit) reads the
      close frame (1009) instead of a TCP reset.
    """

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()
        # TLS in gunicorn itself (lockstep's deployment puts it in nginx) takes no flags: it blocks as before
        self._send_flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_DONTWAIT

    def send(self, data: bytes) -> int:
        """All of `data` (upstream calls send(), which may write only part of a large frame), or TimeoutError
        and the connection shut down once the client has read nothing for SEND_TIMEOUT_S."""
        view = memoryview(data)
        with self._send_lock:
            while view:
                try:  # per call, not the socket's mode: the reader thread blocks in recv on the same socket
                    view = view[self.sock.send(view, self._send_flags):]
                except BlockingIOError:
                    if not self._wait_writable(SEND_TIMEOUT_S):
                        self.shutdown_quietly()
                        raise TimeoutError(f"the client read nothing for {SEND_TIMEOUT_S:.0f} s") from None
        return len(data)

    def _wait_writable(self, timeout_s: float) -> bool:
        poller = select.poll()
        try:
            poller.register(self.sock, select.POLLOUT)
        except ValueError:  # closed meanwhile (its descriptor is -1)
            return False
        return bool(poller.poll(timeout_s * 1000))

    def recv(self, size: int) -> bytes:
        return self.sock.recv(size)

    def fileno(self) -> int:
        return self.sock.fileno()

    def shutdown_quietly(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        """Half-close, read and drop what the client still sends (bounded), then close: closing with unread
        bytes would make the kernel send a reset, and the client would lose our close frame."""
        try:
            self.sock.shutdown(socket.SHUT_WR)
            self._drain()
        except OSError:
            pass
        finally:
            self.sock.close()

    def _drain(self) -> None:
        deadline = time.monotonic() + CLOSE_WAIT_S
        drained = 0
        while drained < MAX_DRAIN_BYTES and (remaining := deadline - time.monotonic()) > 0:
            self.sock.settimeout(remaining)
            chunk = self.sock.recv(65536)
            if not chunk:
                return
            drained += len(chunk)

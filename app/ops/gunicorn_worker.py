"""lockstep's gunicorn worker: gthread with read deadlines and JSON error replies.

gthread already waits for a connection's first byte without holding a thread; after that a
thread reads the request, so a client that trickles its headers or body would hold that
thread as long as it likes. Here every read of a request goes through a deadline: headers
must arrive within LOCKSTEP_HEADER_TIMEOUT_S of the first byte, a body within
LOCKSTEP_BODY_TIMEOUT_S of the headers (408 otherwise). The replies gunicorn writes itself
(400, 408, 414, 431, ...) are JSON in the API's error shape instead of HTML. A finished connection is closed
off the worker's event loop (LingeringCloser).
"""
import functools
import json
import logging
import queue
import resource
import selectors
import socket
import threading
import time

from gunicorn import http, util
from gunicorn.workers.gthread import ThreadWorker
from werkzeug.exceptions import RequestTimeout

from ..errors import BODY_READ_ERRORS
from ..state import EXTENSION_KEY, AppState

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 200


class ReadTimeout(RequestTimeout):
    """The client did not send its request in time. A werkzeug 408, so the app answers it in JSON too."""

    description = "the request was not received in time"


class DeadlineReader:
    """The socket as the request parser sees it: `recv` fails with ReadTimeout once `deadline` has passed.
    The raw socket (environ["gunicorn.socket"], used by the WebSocket) stays as it is."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.deadline: float | None = None

    def recv(self, size: int) -> bytes:
        if self.deadline is None:
            return self.sock.recv(size)
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise ReadTimeout()
        previous = self.sock.gettimeout()
        self.sock.settimeout(remaining if previous is None else min(previous, remaining))
        try:
            return self.sock.recv(size)
        except TimeoutError:
            raise ReadTimeout() from None
        finally:
            self.sock.settimeout(previous)

    def gettimeout(self):  # gunicorn's body drain bounds its reads with these
        return self.sock.gettimeout()

    def settimeout(self, value) -> None:
        self.sock.settimeout(value)


LINGER_S = 2.0  # as gunicorn's own close_graceful
LINGER_MAX_BYTES = 1 << 16
MAX_LINGERING = 1024  # connections waited on at once; past that one is closed at once
FD_RESERVE = 128  # descriptors left beside gunicorn's worker_connections: the model channel, logs, files


class LingeringCloser:
    """Closes finished connections as RFC 9112 section 9.6 asks and gunicorn's close_graceful does: send FIN,
    then read until the client closes (at most LINGER_S or LINGER_MAX_BYTES), so unread bytes never turn into a
    reset that destroys the reply before the client reads it. gunicorn (25 on) waits so on its event loop, one
    connection after another: 5 clients that read a `Connection: close` reply and kept their end open froze every
    new connection for 10 s (/health and /ready included). Here one thread waits on all of them at once."""

    def __init__(self, max_lingering: int = MAX_LINGERING):
        self.max_lingering = max_lingering
        self._handoff: queue.SimpleQueue[socket.socket] = queue.SimpleQueue()
        self._deadlines: dict[socket.socket, float] = {}  # in hand-off order, so in deadline order
        self._drained: dict[socket.socket, int] = {}
        self._stopping = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._wake_reader, self._wake_writer = socket.socketpair()
        for end in (self._wake_reader, self._wake_writer):
            end.setblocking(False)
        self._selector.register(self._wake_reader, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._run, name="lockstep-lingering-close", daemon=True)
        self._thread.start()

    def close(self, sock: socket.socket) -> None:
        """From any thread: FIN now, the close once the client has closed too (or the linger is over)."""
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # already reset by the client, or closed
            util.close(sock)
            return
        if not self._thread.is_alive():  # never a socket left open behind a dead thread
            util.close(sock)
            return
        self._handoff.put(sock)
        self._wake()

    def stop(self, timeout: float) -> None:
        """The worker exits: wait up to `timeout` for the lingering connections to end (the rest close with the
        process)."""
        self._stopping.set()
        self._wake()
        self._thread.join(timeout)

    def _wake(self) -> None:
        try:
            self._wake_writer.send(b"\0")
        except OSError:  # woken already (the byte waiting there is enough), or stopped
            pass

    def _run(self) -> None:
        try:
            self._serve()
        except Exception:  # noqa: BLE001 - a bug here must not leave sockets open: close them, then close at once
            logger.exception("the lingering-close thread failed; connections now close without lingering")
        finally:
            for sock in list(self._deadlines):
                util.close(sock)
            while not self._handoff.empty():
                util.close(self._handoff.get_nowait())
            self._selector.close()
            self._wake_reader.close()
            self._wake_writer.close()

    def _serve(self) -> None:
        while not (self._stopping.is_set() and not self._deadlines and self._handoff.empty()):
            for key, _ in self._selector.select(self._next_timeout()):
                if key.fileobj is self._wake_reader:
                    self._take_handoffs()
                else:
                    self._read(key.fileobj)
            self._close_expired()

    def _next_timeout(self) -> float | None:
        if not self._deadlines:
            return None
        return max(0.0, next(iter(self._deadlines.values())) - time.monotonic())

    def _close_expired(self) -> None:
        now = time.monotonic()
        while self._deadlines:
            sock, deadline = next(iter(self._deadlines.items()))
            if deadline > now:
                break
            self._finish(sock)

    def _take_handoffs(self) -> None:
        try:
            while self._wake_reader.recv(4096):
                pass
        except BlockingIOError:
            pass
        while not self._handoff.empty():
            sock = self._handoff.get_nowait()
            if len(self._deadlines) >= self.max_lingering or sock.fileno() == -1:
                util.close(sock)
                continue
            try:
                sock.setblocking(False)
                self._selector.register(sock, selectors.EVENT_READ)
            except (OSError, ValueError, KeyError):  # closed meanwhile; its descriptor's number reused
                util.close(sock)
                continue
            self._deadlines[sock] = time.monotonic() + LINGER_S
            self._drained[sock] = 0

    def _read(self, sock: socket.socket) -> None:
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:  # reset: nothing left to protect
            data = b""
        self._drained[sock] += len(data)
        if not data or self._drained[sock] >= LINGER_MAX_BYTES:
            self._finish(sock)

    def _finish(self, sock: socket.socket) -> None:
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):  # closed elsewhere meanwhile
            pass
        del self._deadlines[sock], self._drained[sock]
        util.close(sock)


def lingering_room(worker_connections: int) -> int:
    """How many closing connections may linger beside gunicorn's own: its count stops at the close, and past
    the descriptor limit accept() fails and the worker dies."""
    soft_limit, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft_limit == resource.RLIM_INFINITY:
        return MAX_LINGERING
    return max(0, min(MAX_LINGERING, soft_limit - worker_connections - FD_RESERVE))


def _close_socket(closer: LingeringCloser, sock: socket.socket, graceful: bool = False) -> None:
    """gthread's TConn.close, lingering on the closer's thread instead of the event loop's."""
    if graceful:
        closer.close(sock)
    else:
        util.close(sock)


class LockstepWorker(ThreadWorker):
    app_state: AppState | None = None  # once the app is loaded: its settings, and what gunicorn.conf.py drains
    closer: LingeringCloser | None = None

    def load_wsgi(self):
        super().load_wsgi()
        self.app_state = self.wsgi.extensions[EXTENSION_KEY]
        self.wsgi = honour_connection_close(self.wsgi)
        self.closer = LingeringCloser(lingering_room(self.cfg.worker_connections))

    def run(self):
        try:
            super().run()
        finally:
            if self.closer is not None:
                self.closer.stop(LINGER_S)

    def handle(self, conn):
        if self.closer is not None:  # conn.sock is final here (TLS wrapped); bound to it, not to conn: no cycle
            conn.close = functools.partial(_close_socket, self.closer, conn.sock)
        if conn.parser is None and not self.cfg.is_ssl:
            conn.parser = http.get_parser(self.cfg, DeadlineReader(conn.sock), conn.client)
        reader = _deadline_reader(conn)
        if reader is not None:
            reader.deadline = time.monotonic() + self.app_state.settings.header_timeout_s
        try:
            return super().handle(conn)
        finally:
            if reader is not None:
                reader.deadline = None

    def handle_request(self, req, conn):
        reader = _deadline_reader(conn)
        if reader is not None:
            reader.deadline = time.monotonic() + self.app_state.settings.body_timeout_s
        try:
            return super().handle_request(req, conn)
        finally:
            if reader is not None:
                reader.deadline = None  # the response is out; gunicorn's own drain bounds what follows

    def handle_error(self, req, client, addr, exc):
        """gunicorn picks the status and logs; the reply it would write is replaced by a JSON one."""
        if isinstance(exc, ReadTimeout):
            logger.info("closing a connection that did not send its request in time")
            write_json_error(client, 408, "Request Timeout", ReadTimeout.description, "request_timeout")
            return
        reply = CapturedReply()
        super().handle_error(req, reply, addr, exc)
        status, reason = reply.status()
        message = f"{reason}: {exc}" if str(exc) and status < 500 else reason
        write_json_error(client, status, reason, message[:MAX_MESSAGE_CHARS], reason.lower().replace(" ", "_"))


def _deadline_reader(conn) -> DeadlineReader | None:
    unreader = getattr(conn.parser, "unreader", None)
    reader = getattr(unreader, "sock", None)
    return reader if isinstance(reader, DeadlineReader) else None


class CapturedReply:
    """Stands in for the client socket while gunicorn writes its HTML error page, to learn the status."""

    def __init__(self):
        self.data = b""

    def gettimeout(self):
        return None

    def setblocking(self, flag) -> None:
        pass

    def sendall(self, data: bytes) -> None:
        self.data += data

    def status(self) -> tuple[int, str]:
        line = self.data.split(b"\r\n", 1)[0].decode("latin-1")
        try:
            _, code, reason = line.split(" ", 2)
            return int(code), reason
        except ValueError:
            return 500, "Internal Server Error"


def write_json_error(sock, status: int, reason: str, message: str, code: str) -> None:
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1")
    try:
        sock.setblocking(False)  # never wait on a client that does not read
        sock.sendall(head + body)
    except OSError:
        logger.debug("could not send the error reply")


def honour_connection_close(app):
    """gunicorn drops a `Connection` header set by the app (hop-by-hop); this makes it close the connection
    instead, so that after a 408 or 413 an unread body is never parsed as the next request. After a 413 is
    sent, the rest of the body is read (within the body deadline, up to DISCARD_LIMIT_BYTES) before the close:
    closing a socket with unread data sends a reset, which can destroy the 413 before the client reads it."""

    def wrapped(environ, start_response):
        statuses = []

        def start(status, headers, exc_info=None):
            statuses.append(status)
            if any(k.lower() == "connection" and v.lower() == "close" for k, v in headers):
                response = getattr(start_response, "__self__", None)
                if response is not None and hasattr(response, "force_close"):
                    response.force_close()
            return start_response(status, headers, exc_info)

        result = app(environ, start)
        if statuses and statuses[-1].startswith("413"):
            return DiscardBodyOnClose(result, environ.get("wsgi.input"))
        return result

    return wrapped


class DiscardBodyOnClose:
    """A reply whose `close` (called by gunicorn once the reply is written) reads what is left of the body."""

    def __init__(self, reply, body):
        self.reply, self.body = reply, body

    def __iter__(self):
        return iter(self.reply)

    def close(self) -> None:
        try:
            discard_unread_body(self.body)
        finally:
            if hasattr(self.reply, "close"):
                self.reply.close()


DISCARD_LIMIT_BYTES = 8 << 20


def discard_unread_body(body) -> None:
    """Read what is left of a refused body (a client past the limit or the deadline is cut off)."""
    left = DISCARD_LIMIT_BYTES
    try:
        while body is not None and left > 0 and (chunk := body.read(min(1 << 16, left))):
            left -= len(chunk)
    except (*BODY_READ_ERRORS, RequestTimeout):
        logger.debug("stopped reading a refused body")

"""lockstep's gunicorn worker: gthread with read deadlines and JSON error replies.

gthread already waits for a connection's first byte without holding a thread; after that a
thread reads the request, so a client that trickles its headers or body would hold that
thread as long as it likes. Here every read of a request goes through a deadline: headers
must arrive within LOCKSTEP_HEADER_TIMEOUT_S of the first byte, a body within
LOCKSTEP_BODY_TIMEOUT_S of the headers (408 otherwise). The replies gunicorn writes itself
(400, 408, 414, 431, ...) are JSON in the API's error shape instead of HTML.
"""
import json
import logging
import socket
import time

from gunicorn import http
from gunicorn.workers.gthread import ThreadWorker
from werkzeug.exceptions import RequestTimeout

from .errors import BODY_READ_ERRORS
from .state import EXTENSION_KEY, AppState

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


class LockstepWorker(ThreadWorker):
    app_state: AppState | None = None  # once the app is loaded: its settings, and what gunicorn.conf.py drains

    def load_wsgi(self):
        super().load_wsgi()
        self.app_state = self.wsgi.extensions[EXTENSION_KEY]
        self.wsgi = honour_connection_close(self.wsgi)

    def handle(self, conn):
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
    instead, so that after a 408 or 413 an unread body is never parsed as the next request. After a 413 the
    rest of the body is read first (within the body deadline, up to DISCARD_LIMIT_BYTES): closing a socket
    with unread data sends a reset, which can destroy the 413 before the client reads it."""

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
            discard_unread_body(environ.get("wsgi.input"))
        return result

    return wrapped


DISCARD_LIMIT_BYTES = 8 << 20


def discard_unread_body(body) -> None:
    """Read what is left of a refused body (a client past the limit or the deadline is cut off)."""
    left = DISCARD_LIMIT_BYTES
    try:
        while body is not None and left > 0 and (chunk := body.read(min(1 << 16, left))):
            left -= len(chunk)
    except (*BODY_READ_ERRORS, RequestTimeout):
        logger.debug("stopped reading a refused body")

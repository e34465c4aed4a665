"""What every WebSocket route shares: the refusals before the upgrade, the socket, and a session loop.

The routes are flask-sock's (`@sock.route(path, bp=bp)`): flask-sock upgrades with simple_websocket's Server,
built from the request's environ and SOCK_SERVER_OPTIONS (ping interval, frame limit), and calls the route
with it. What must happen before the upgrade is a `before_request` hook here, the last one (after Host,
Origin, drain and key): a broken handshake (400/426) or a socket over the cap (503) is refused with a JSON
body, and an accepted one holds a socket slot that `teardown_request` gives back. The same hook puts a
GuardedSocket in the environ, so the Server flask-sock builds sends under one lock and closes lingering.

One thread owns a session's state and does every send: it blocks on one queue that receives both the
engine's events for the session's requests and the frames that a small reader thread takes off the
socket. Closing the socket cancels the session's running requests. A protocol (app/ws.py, app/responses_ws.py)
subclasses SocketSession and says what a frame and an engine event do.

Every way out of a session ends with a close code: 1000 (done), 1001 (idle, shutdown), 1003
(binary frame), 1007 (invalid UTF-8), 1008 (authentication), 1009 (frame too big), 1011 (a
bug). An error frame, by contrast, leaves the socket usable.
"""
import json
import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from flask import Response, g, request
from flask_sock import Sock
from simple_websocket import ConnectionClosed, Server
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError

from engine import EngineError

from .errors import ApiError, error_response, from_engine_error
from .guards import SOCKET_ENDPOINTS
from .schema import parse_json_object
from .state import AppState, lockstep

logger = logging.getLogger(__name__)

TICK_S = 1.0  # how often an idle session looks at its timers (auth, idle, drain)
CLOSE_WAIT_S = 2.0  # how long a closing socket waits for the client's close reply, and drains what it still sends
MAX_DRAIN_BYTES = 4 << 20
WEBSOCKET_VERSION = "13"
CONNECTION_KEYS = ("gunicorn.socket", "werkzeug.socket")  # where simple_websocket finds the connection
INTERNAL_ERROR = ApiError(500, "internal server error", "internal_error")

sock = Sock()  # stateless until init_app: the routes are registered on their blueprints


def init_app(app) -> None:
    """flask-sock's options and the upgrade's hooks. Call after register_guards: this hook must run last."""
    app.config["SOCK_SERVER_OPTIONS"] = socket_options(app.extensions["lockstep"].settings)
    app.before_request(_prepare_upgrade)
    app.teardown_request(_release_socket_slot)
    sock.init_app(app)


@dataclass(frozen=True)
class ClientFrame:
    data: str | bytes


@dataclass(frozen=True)
class SocketClosed:
    pass


class SessionClosing(Exception):
    """Ends a session with a close code (auth failure, binary frame...)."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


def serve_socket(ws: Server, make_session: Callable[[Server, AppState], "SocketSession"]) -> None:
    """A flask-sock route's body: run the session to its end, then close the socket cleanly."""
    try:
        make_session(ws, lockstep()).run()
    except Exception:  # noqa: BLE001 - past the upgrade no HTTP error may follow: the connection is the socket's
        logger.exception("socket session failed")
    finally:
        finish(ws)


def _prepare_upgrade() -> Response | None:
    if request.endpoint not in SOCKET_ENDPOINTS:
        return None
    refusal = check_handshake(lockstep())
    if refusal is not None:
        return refusal
    g.holds_socket_slot = True
    for key in CONNECTION_KEYS:
        if key in request.environ:
            request.environ[key] = GuardedSocket(request.environ[key])
    return None


def _release_socket_slot(_error=None) -> None:
    if g.pop("holds_socket_slot", False):
        lockstep().sockets.release()


def check_handshake(state: AppState) -> Response | None:
    """Refuse before the upgrade, with a JSON body: a broken handshake (400/426), too many sockets (503).
    On None a socket slot is held: teardown releases it."""
    if not request.headers.get("Sec-WebSocket-Key"):
        return error_response(ApiError(400, "a WebSocket upgrade needs Sec-WebSocket-Key", "invalid_handshake"))
    if request.headers.get("Sec-WebSocket-Version") != WEBSOCKET_VERSION:
        response = error_response(ApiError(426, "only WebSocket version 13 is supported", "invalid_handshake"))
        response.headers["Sec-WebSocket-Version"] = WEBSOCKET_VERSION
        return response
    if not state.sockets.try_acquire():
        logger.warning("refused a socket: %d are open (LOCKSTEP_MAX_SOCKETS)", state.sockets.limit)
        return error_response(ApiError(503, f"too many open sockets (at most {state.sockets.limit}); retry shortly",
                                       "too_many_sockets", type_="server_error"))
    return None


class SocketSession:
    """The loop every protocol shares. Subclasses implement `on_message` (a parsed, authenticated frame),
    `on_engine_event` (a DeltaEvent or RequestOutput of theirs), `error_frame`, `has_running` and
    `cancel_all`; `reference_of` picks what an error about a frame names (its id, its lane)."""

    def __init__(self, ws: Server, state: AppState, client: str, is_authenticated: bool):
        self.ws = ws
        self.state = state
        self.engine = state.engine
        self.settings = state.settings
        self.client = client
        self.is_authenticated = is_authenticated
        self.inbox: queue.Queue = queue.Queue()
        self.is_open = True
        self.opened_at = self.last_activity = time.monotonic()

    # -- what a protocol says ------------------------------------------------------------------------------

    def on_message(self, message: dict) -> None:
        raise NotImplementedError

    def on_engine_event(self, item) -> None:
        raise NotImplementedError

    def error_frame(self, reference, error: ApiError) -> dict:
        raise NotImplementedError

    def has_running(self) -> bool:
        raise NotImplementedError

    def cancel_all(self) -> None:
        raise NotImplementedError

    def reference_of(self, message: dict):
        return None

    def engine_reference(self, item):
        """What an error about one of the engine's events names (the request's client id...)."""
        return None

    def authenticate(self, message: dict) -> None:
        raise SessionClosing(CloseReason.POLICY_VIOLATION, "authentication required")

    # -- the loop ------------------------------------------------------------------------------------------

    def run(self) -> None:
        threading.Thread(target=self._read_frames, name="ws-reader", daemon=True).start()
        code, reason = CloseReason.NORMAL_CLOSURE, ""
        try:
            while self.is_open:
                try:
                    item = self.inbox.get(timeout=TICK_S)
                except queue.Empty:
                    self._check_timers()
                    continue
                self._dispatch_safely(item)
        except SessionClosing as closing:
            code, reason = closing.code, closing.reason
        finally:
            self.cancel_all()
        close_with(self.ws, code, reason)

    def _read_frames(self) -> None:
        try:
            while (data := self.ws.receive()) is not None:
                self.inbox.put(ClientFrame(data))
        except ConnectionClosed:
            pass
        except Exception:  # a bug in the reader must still end the session
            logger.exception("socket reader failed")
        self.inbox.put(SocketClosed())

    def _check_timers(self) -> None:
        now = time.monotonic()
        if not self.is_authenticated and now - self.opened_at > self.settings.ws_auth_timeout_s:
            raise SessionClosing(CloseReason.POLICY_VIOLATION, "authentication timeout")
        if self.has_running():
            return
        if self.state.is_draining:
            logger.info("closing an idle socket for shutdown")
            raise SessionClosing(CloseReason.GOING_AWAY, "server shutting down")
        if now - self.last_activity > self.settings.ws_idle_timeout_s:
            logger.info("closing a socket idle for %.0f s", now - self.last_activity)
            raise SessionClosing(CloseReason.GOING_AWAY, "idle timeout")

    def _dispatch_safely(self, item) -> None:
        """A bug while handling one item costs an error frame, never the socket (nor an escaped exception)."""
        try:
            self._dispatch(item)
        except SessionClosing:
            raise
        except Exception:
            logger.exception("socket session error")
            self.send(self.error_frame(self.engine_reference(item), INTERNAL_ERROR))

    def _dispatch(self, item) -> None:
        match item:
            case ClientFrame(data):
                self.last_activity = time.monotonic()
                self._on_frame(data)
            case SocketClosed():
                self.is_open = False
            case _:
                self.last_activity = time.monotonic()
                self.on_engine_event(item)

    def _on_frame(self, data: str | bytes) -> None:
        if isinstance(data, bytes):
            raise SessionClosing(CloseReason.UNSUPPORTED_DATA, "binary frames are not supported; send JSON text")
        reference = None
        try:
            message = parse_json_object(data)
            reference = self.reference_of(message)
            if not self.is_authenticated:
                self.authenticate(message)
                return
            self.on_message(message)
        except ApiError as exc:
            self.send(self.error_frame(reference, exc))
        except EngineError as exc:
            self.send(self.error_frame(reference, from_engine_error(exc)))
        except SessionClosing:
            raise
        except Exception:  # a bug below (a chat template that raises...): this request fails, the socket stays
            logger.exception("socket request failed")
            self.send(self.error_frame(reference, INTERNAL_ERROR))

    def send(self, message: dict) -> None:
        self.send_text(json.dumps(message))

    def send_text(self, text: str) -> None:
        if not self.is_open:
            return
        try:
            self.ws.send(text)
        except (ConnectionClosed, OSError, LocalProtocolError):  # the client is gone (BrokenPipe, reset), or
            self.is_open = False  # the socket is already closing (a close code was sent): end the session


def close_with(ws: Server, code: int, reason: str) -> None:
    """Send a close frame unless one went already. Wakes a `receive` that waits: upstream leaves it blocked
    once it has sent its close frame, until the client answers."""
    if not ws.connected:
        return
    try:
        ws.close(code, reason)
    except (ConnectionClosed, OSError, LocalProtocolError):  # closing or closed already
        pass
    finally:
        ws.event.set()


def finish(ws: Server) -> None:
    """Wait for the client's close reply (bounded), then let the socket's thread close the connection."""
    close_with(ws, CloseReason.NORMAL_CLOSURE, "")
    ws.thread.join(CLOSE_WAIT_S)
    if ws.thread.is_alive():  # the client never answered the close: cut the connection
        ws.sock.shutdown_quietly()
        ws.thread.join(CLOSE_WAIT_S)


class GuardedSocket:
    """The connection's socket as simple_websocket uses it (send, recv, fileno, close), adapted:

    - one lock around sends (the ping thread and the session both send) and `sendall`, not `send`;
    - a lingering close, so a client still sending (a 1 MiB frame past the 256 KiB limit) reads the
      close frame (1009) instead of a TCP reset.
    """

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, data: bytes) -> int:
        with self._send_lock:
            self.sock.sendall(data)  # upstream calls send(), which may write only part of a large frame
        return len(data)

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


def socket_options(settings) -> dict:
    return {"ping_interval": settings.ws_ping_interval_s, "max_message_size": settings.ws_max_message_bytes}

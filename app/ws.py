"""WebSocket /ws: typed JSON frames, several requests per socket told apart by the client's `id`.

One thread owns the socket's state and does every send: it blocks on one queue that
receives both the engine's events for this socket's requests and the frames that a small
reader thread takes off the socket. Closing the socket cancels its running requests.

Every way out of a session ends with a close code: 1000 (done), 1001 (idle, shutdown), 1003
(binary frame), 1007 (invalid UTF-8), 1008 (authentication), 1009 (frame too big), 1011 (a
bug). An error frame, by contrast, leaves the socket usable.

The route is ours rather than flask-sock's decorator (which it mirrors) so that a socket over
the cap or a bad handshake is refused before the upgrade, and so that the socket is a
LockstepSocket: simple_websocket's Server with a close that lets the client read the close
frame (see GuardedSocket).
"""
import json
import logging
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from flask import Blueprint, Response, g, request
from simple_websocket import ConnectionClosed, Server
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError

from engine import EngineError, FinishReason, InvalidRequest, RequestOutput, SamplingParams
from engine.sequence import DeltaEvent

from .api import client_address
from .choices import chat_logprob_content
from .errors import (INVALID_VALUE, ApiError, error_response, from_engine_error, from_failed_output, invalid_value,
                     missing_field, ws_error)
from .guards import keys_match
from .schema import WS_GENERATE, checked_fields, messages_field, parse_json_object, prompt_field, sampling_fields
from .state import AppState, lockstep

logger = logging.getLogger(__name__)

bp = Blueprint("ws", __name__)

MAX_ID_LENGTH = 128
TICK_S = 1.0  # how often an idle session looks at its timers (auth, idle, drain)
CLOSE_WAIT_S = 2.0  # how long a closing socket waits for the client's close reply, and drains what it still sends
MAX_DRAIN_BYTES = 4 << 20
WEBSOCKET_VERSION = "13"
INTERNAL_ERROR = ApiError(500, "internal server error", "internal_error")


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


@bp.route("/ws", websocket=True)
def chat_socket():
    state = lockstep()
    refusal = _check_handshake(state)
    if refusal is not None:
        return refusal
    try:
        ws = LockstepSocket(request.environ, **socket_options(state.settings))
        try:
            SocketSession(ws, state, client_address(), g.get("is_authenticated", False)).run()
        except Exception:  # noqa: BLE001 - past the upgrade no HTTP error may follow: the connection is the socket's
            logger.exception("socket session failed")
        finally:
            ws.finish()
    finally:
        state.sockets.release()
    return SocketDone()


def _check_handshake(state: AppState) -> Response | None:
    """Refuse before the upgrade, with a JSON body: a broken handshake (400/426), too many sockets (503).
    On None a socket slot is held: the route releases it."""
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


class SocketDone(Response):
    """What the route returns once the socket is closed (as flask-sock does): under gunicorn the connection
    is the socket's, so no HTTP response may follow; werkzeug writes one to the closed socket and ignores it."""

    def __call__(self, environ, start_response):
        if "gunicorn.socket" in environ:
            raise StopIteration()  # gunicorn: "close this connection"
        return super().__call__(environ, start_response)


class SocketSession:
    def __init__(self, ws: "LockstepSocket", state: AppState, client: str, is_authenticated: bool):
        self.ws = ws
        self.state = state
        self.engine = state.engine
        self.settings = state.settings
        self.client = client
        self.is_authenticated = is_authenticated
        self.inbox: queue.Queue = queue.Queue()
        self.client_ids: dict[str, str] = {}  # engine request id -> client id
        self.request_ids: dict[str, str] = {}  # client id -> engine request id
        self.samplings: dict[str, SamplingParams] = {}  # engine request id -> what it asked for (n, logprobs)
        self.is_open = True
        self.opened_at = self.last_activity = time.monotonic()

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
            self._cancel_all()
        self.ws.close_with(code, reason)

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
        if self.request_ids:
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
            self._send(ws_error(self.client_ids.get(getattr(item, "request_id", None)), INTERNAL_ERROR))

    def _dispatch(self, item) -> None:
        match item:
            case ClientFrame(data):
                self.last_activity = time.monotonic()
                self._on_frame(data)
            case DeltaEvent():
                self._send(self._delta_frame(item))
            case RequestOutput():
                self.last_activity = time.monotonic()
                self._on_finished(item)
            case SocketClosed():
                self.is_open = False

    def _on_frame(self, data: str | bytes) -> None:
        if isinstance(data, bytes):
            raise SessionClosing(CloseReason.UNSUPPORTED_DATA, "binary frames are not supported; send JSON text")
        client_id = None
        try:
            message = parse_json_object(data)
            client_id = message.get("id")
            if not self.is_authenticated:
                self._authenticate(message)
                return
            match message.get("type"):
                case "generate":
                    self._start_request(message)
                case "cancel":
                    self._cancel(message)
                case "auth":
                    self._send({"type": "ready"})
                case other:
                    raise ApiError(400, f"unknown message type {other!r}; use generate or cancel", INVALID_VALUE,
                                   "type")
        except ApiError as exc:
            self._send(ws_error(_printable_id(client_id), exc))
        except EngineError as exc:
            self._send(ws_error(_printable_id(client_id), from_engine_error(exc)))
        except SessionClosing:
            raise
        except Exception:  # a bug below (a chat template that raises...): this request fails, the socket stays
            logger.exception("socket request failed")
            self._send(ws_error(_printable_id(client_id), INTERNAL_ERROR))

    def _authenticate(self, message: dict) -> None:
        """The first frame of a socket without a key on its handshake: {"type": "auth", "api_key": "..."}."""
        if message.get("type") != "auth":
            error = ApiError(401, 'authenticate first: {"type": "auth", "api_key": "..."}', "auth_required")
        elif not keys_match(message.get("api_key"), self.settings.api_key):
            error = ApiError(401, "invalid API key", "invalid_api_key")
        else:
            self.is_authenticated = True
            self._send({"type": "ready"})
            return
        self._send(ws_error(None, error))
        raise SessionClosing(CloseReason.POLICY_VIOLATION, error.message)

    def _start_request(self, message: dict) -> None:
        client_id = _client_id(message)
        if client_id in self.request_ids:
            raise ApiError(409, f"a request with id {client_id!r} is already running on this socket", "duplicate_id",
                           "id")
        message = checked_fields(message, WS_GENERATE)
        if "messages" in message:
            prompt, messages = None, messages_field(message)
        else:
            prompt, messages = prompt_field(message), None
        sampling = sampling_fields(message, self.engine)
        if sampling.num_samples > sampling.n:
            raise InvalidRequest("best_of cannot be streamed (the samples not returned would be); use REST",
                                 "best_of")
        request_id = f"ws-{uuid.uuid4().hex[:12]}"
        self.engine.submit(prompt, sampling, messages=messages, request_id=request_id, sink=self.inbox,
                           client_id=self.client, timeout_s=message.get("timeout"))
        self.client_ids[request_id], self.request_ids[client_id] = client_id, request_id
        self.samplings[request_id] = sampling
        self._send({"type": "start", "id": client_id})

    def _delta_frame(self, event: DeltaEvent) -> dict:
        """`index` with n > 1; `logprobs` (chat's content entries, for the tokens since the last delta) when asked."""
        frame = {"type": "delta", "id": self.client_ids.get(event.request_id), "text": event.text}
        sampling = self.samplings.get(event.request_id)
        if sampling is not None and sampling.n > 1:
            frame["index"] = event.index
        if sampling is not None and sampling.logprobs is not None:
            frame["logprobs"] = chat_logprob_content(event.logprobs, self.engine.token_texts)
        return frame

    def _cancel(self, message: dict) -> None:
        client_id = _client_id(message)
        request_id = self.request_ids.get(client_id)
        if request_id is None:
            raise ApiError(404, f"no running request with id {client_id!r}", "unknown_id", "id")
        self.engine.cancel(request_id)  # its `done` (finish_reason abort) follows from the engine

    def _on_finished(self, output: RequestOutput) -> None:
        client_id = self.client_ids.pop(output.request_id, None)
        self.request_ids.pop(client_id, None)
        sampling = self.samplings.pop(output.request_id, None)
        if output.finish_reason is FinishReason.ERROR:
            self._send(ws_error(client_id, from_failed_output(output)))
        else:
            done = {"type": "done", "id": client_id, "finish_reason": output.finish_reason.value,
                    "usage": output.usage.as_dict(), "timing": output.timings.as_dict()}
            if sampling is not None and sampling.n > 1:
                done["choices"] = [{"index": c.index, "finish_reason": c.finish_reason.value} for c in output.choices]
            self._send(done)
        logger.info("ws request %s finish=%s tokens=%d e2e_ms=%.0f", output.request_id,
                    output.finish_reason.value, output.usage.completion_tokens, output.timings.e2e_s * 1000)

    def _send(self, message: dict) -> None:
        if not self.is_open:
            return
        try:
            self.ws.send(json.dumps(message))
        except (ConnectionClosed, OSError, LocalProtocolError):  # the client is gone (BrokenPipe, reset), or
            self.is_open = False  # the socket is already closing (a close code was sent): end the session

    def _cancel_all(self) -> None:
        for request_id in list(self.client_ids):
            self.engine.cancel(request_id)


class LockstepSocket(Server):
    """simple_websocket's server socket, adapted (documented here, small):

    - its socket is a GuardedSocket: one lock around sends (the ping thread and the session both send),
      and a lingering close, so a client still sending (a 1 MiB frame past the 256 KiB limit) reads the
      close frame (1009) instead of a TCP reset;
    - `close` wakes a `receive` that waits (upstream leaves it blocked once the socket is closed).
    """

    def __init__(self, environ, **options):
        environ = dict(environ)
        for key in ("gunicorn.socket", "werkzeug.socket"):
            if key in environ:
                environ[key] = GuardedSocket(environ[key])
        super().__init__(environ, **options)

    def close(self, reason=None, message=None):
        try:
            super().close(reason, message)
        finally:
            self.event.set()

    def close_with(self, code: int, reason: str) -> None:
        if not self.connected:
            return
        try:
            self.close(code, reason)
        except (ConnectionClosed, OSError, LocalProtocolError):  # closing or closed already
            pass

    def finish(self) -> None:
        """Wait for the client's close reply (bounded), then let the socket's thread close the connection."""
        self.close_with(CloseReason.NORMAL_CLOSURE, "")
        self.thread.join(CLOSE_WAIT_S)
        if self.thread.is_alive():  # the client never answered the close: cut the connection
            self.sock.shutdown_quietly()
            self.thread.join(CLOSE_WAIT_S)


class GuardedSocket:
    """The connection's socket as simple_websocket uses it (send, recv, fileno, close)."""

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


def _client_id(message: dict) -> str:
    client_id = message.get("id")
    if client_id is None:
        raise missing_field("id")
    if not isinstance(client_id, str) or not client_id or len(client_id) > MAX_ID_LENGTH:
        raise invalid_value("id", f"id must be a non-empty string of at most {MAX_ID_LENGTH} characters")
    return client_id


def _printable_id(client_id):
    return client_id if isinstance(client_id, str) and len(client_id) <= MAX_ID_LENGTH else None


def socket_options(settings) -> dict:
    return {"ping_interval": settings.ws_ping_interval_s, "max_message_size": settings.ws_max_message_bytes}

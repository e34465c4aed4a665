"""The loop every WebSocket session shares: one thread owns a session's state and does every send.

It blocks on one queue that receives both the engine's events for the session's requests and the frames that a
small reader thread takes off the socket. A protocol (app/sockets/ws_session.py, app/responses/ws_session.py) subclasses
SocketSession and says what a frame and an engine event do; its streams are its own records.

Every way out of a session ends with a close code: 1000 (done), 1001 (idle, shutdown), 1003 (binary frame),
1007 (invalid UTF-8), 1008 (authentication), 1009 (frame too big), 1011 (a bug). An error frame, by contrast,
leaves the socket usable. Closing the socket cancels the session's running requests.
"""
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from simple_websocket import ConnectionClosed
from wsproto.frame_protocol import CloseReason

from engine import EngineError

from ..errors import INTERNAL_ERROR, INTERNAL_ERROR_MESSAGE, ApiError, from_engine_error
from ..rest.request_parsing import parse_json_object, refuse_lone_surrogates
from ..state import AppState
from .transport import SocketTransport

logger = logging.getLogger(__name__)

TICK_S = 1.0  # how often an idle session looks at its timers (auth, idle, drain)
INTERNAL = ApiError(500, INTERNAL_ERROR_MESSAGE, INTERNAL_ERROR, type_="server_error")


@dataclass(frozen=True)
class ClientFrame:
    data: str | bytes


@dataclass(frozen=True)
class SocketClosed:
    pass


class Stream(Protocol):
    """A protocol's record of one running request on its socket."""

    @property
    def reference(self) -> str | None:
        """What an error about it names (the client's id for it, its lane)."""


class SessionClosing(Exception):
    """Ends a session with a close code (auth failure, binary frame...)."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code, self.reason = code, reason


class SocketSession:
    """Subclasses implement `on_message` (a parsed, authenticated frame), `on_engine_event` (a DeltaEvent or
    RequestOutput of theirs) and `error_frame`; `reference_of` picks what an error about a frame names (its id,
    its lane). They keep a record of each request they submit in `streams` until its RequestOutput."""

    def __init__(self, transport: SocketTransport, state: AppState, client: str, is_authenticated: bool):
        self.transport = transport
        self.state = state
        self.engine = state.engine
        self.settings = state.settings
        self.client = client
        self.is_authenticated = is_authenticated
        self.inbox: queue.Queue = queue.Queue()
        self.streams: dict[str, Stream] = {}  # engine request id -> the protocol's record of it
        self.opened_at = self.last_activity = time.monotonic()

    # -- what a protocol says ------------------------------------------------------------------------------

    def on_message(self, message: dict) -> None:
        raise NotImplementedError

    def on_engine_event(self, item) -> None:
        raise NotImplementedError

    def error_frame(self, reference, error: ApiError) -> dict:
        raise NotImplementedError

    def reference_of(self, message: dict):
        return None

    def authenticate(self, message: dict) -> None:
        raise SessionClosing(CloseReason.POLICY_VIOLATION, "authentication required")

    # -- the streams ---------------------------------------------------------------------------------------

    def has_running(self) -> bool:
        return bool(self.streams)

    def cancel_all(self) -> None:
        for request_id in list(self.streams):
            self.engine.cancel(request_id)  # each one's RequestOutput follows from the engine

    def engine_reference(self, item) -> str | None:
        """What an error about one of the engine's events names."""
        stream = self.streams.get(getattr(item, "request_id", None))
        return stream.reference if stream is not None else None

    def send_error(self, reference, exc: ApiError | EngineError) -> None:
        """A request that cannot start or go on: its error frame, in the protocol's shape."""
        error = from_engine_error(exc) if isinstance(exc, EngineError) else exc
        self.transport.send(self.error_frame(reference, error))

    # -- the loop ------------------------------------------------------------------------------------------

    def run(self) -> None:
        threading.Thread(target=self._read_frames, name="ws-reader", daemon=True).start()
        code, reason = CloseReason.NORMAL_CLOSURE, ""
        try:
            while self.transport.is_open:
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
        self.transport.close(code, reason)

    def _read_frames(self) -> None:
        try:
            while (data := self.transport.receive()) is not None:
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
            self.send_error(self.engine_reference(item), INTERNAL)

    def _dispatch(self, item) -> None:
        match item:
            case ClientFrame(data):
                self.last_activity = time.monotonic()
                self._on_frame(data)
            case SocketClosed():
                self.transport.mark_closed()
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
            refuse_lone_surrogates(message, data)
            self.on_message(message)
        except (ApiError, EngineError) as exc:
            self.send_error(reference, exc)
        except SessionClosing:
            raise
        except Exception:  # a bug below (a chat template that raises...): this request fails, the socket stays
            logger.exception("socket request failed")
            self.send_error(reference, INTERNAL)

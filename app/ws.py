"""WebSocket /ws: typed JSON frames, several requests per socket told apart by the client's `id`.

One thread owns the socket's state and does every send: it blocks on one queue that
receives both the engine's events for this socket's requests and the frames that a small
reader thread takes off the socket. Closing the socket cancels its running requests.
"""
import json
import logging
import queue
import threading
import uuid
from dataclasses import dataclass

from flask import Blueprint
from flask_sock import Sock
from simple_websocket import ConnectionClosed

from engine import EngineError, FinishReason, RequestOutput
from engine.sequence import DeltaEvent

from .errors import ApiError, from_engine_error, from_failed_output, ws_error
from .schema import messages_field, parse_json_object, prompt_field, sampling_fields
from .state import AppState, lockstep

logger = logging.getLogger(__name__)

bp = Blueprint("ws", __name__)
sock = Sock()  # only its route decorator is used; the route lives on `bp`, so no app is stored here

MAX_ID_LENGTH = 128
IDLE_CHECK_S = 1.0


@dataclass(frozen=True)
class ClientFrame:
    data: str | bytes


@dataclass(frozen=True)
class SocketClosed:
    pass


@sock.route("/ws", bp=bp)
def chat_socket(ws):
    SocketSession(ws, lockstep()).run()


class SocketSession:
    def __init__(self, ws, state: AppState):
        self.ws = ws
        self.state = state
        self.engine = state.engine
        self.inbox: queue.Queue = queue.Queue()
        self.client_ids: dict[str, str] = {}  # engine request id -> client id
        self.request_ids: dict[str, str] = {}  # client id -> engine request id
        self.is_open = True

    def run(self) -> None:
        reader = threading.Thread(target=self._read_frames, name="ws-reader", daemon=True)
        reader.start()
        try:
            while self.is_open:
                try:
                    item = self.inbox.get(timeout=IDLE_CHECK_S)
                except queue.Empty:
                    self._close_if_draining()
                    continue
                self._dispatch(item)
        finally:
            self._cancel_all()

    def _read_frames(self) -> None:
        try:
            while True:
                data = self.ws.receive()
                if data is None:
                    break
                self.inbox.put(ClientFrame(data))
        except ConnectionClosed:
            pass
        self.inbox.put(SocketClosed())

    def _dispatch(self, item) -> None:
        match item:
            case ClientFrame(data):
                self._on_frame(data)
            case DeltaEvent(request_id, text):
                self._send({"type": "delta", "id": self.client_ids.get(request_id), "text": text})
            case RequestOutput():
                self._on_finished(item)
            case SocketClosed():
                self.is_open = False

    def _on_frame(self, data: str | bytes) -> None:
        client_id = None
        try:
            message = parse_json_object(data)
            client_id = message.get("id")
            match message.get("type"):
                case "generate":
                    self._start_request(message)
                case "cancel":
                    self._cancel(message)
                case other:
                    raise ApiError(400, f"unknown message type {other!r}; use generate or cancel", "unknown_type",
                                   "type")
        except ApiError as exc:
            self._send(ws_error(_printable_id(client_id), exc))
        except EngineError as exc:
            self._send(ws_error(_printable_id(client_id), from_engine_error(exc)))

    def _start_request(self, message: dict) -> None:
        client_id = _client_id(message)
        if client_id in self.request_ids:
            raise ApiError(409, f"a request with id {client_id!r} is already running on this socket", "duplicate_id",
                           "id")
        if "messages" in message:
            prompt, messages = None, messages_field(message)
        else:
            prompt, messages = prompt_field(message), None
        sampling = sampling_fields(message, self.engine)
        request_id = f"ws-{uuid.uuid4().hex[:12]}"
        self.engine.submit(prompt, sampling, messages=messages, request_id=request_id, sink=self.inbox)
        self.client_ids[request_id], self.request_ids[client_id] = client_id, request_id
        self._send({"type": "start", "id": client_id})

    def _cancel(self, message: dict) -> None:
        client_id = _client_id(message)
        request_id = self.request_ids.get(client_id)
        if request_id is None:
            raise ApiError(404, f"no running request with id {client_id!r}", "unknown_id", "id")
        self.engine.cancel(request_id)  # its `done` (finish_reason abort) follows from the engine

    def _on_finished(self, output: RequestOutput) -> None:
        client_id = self.client_ids.pop(output.request_id, None)
        self.request_ids.pop(client_id, None)
        if output.finish_reason is FinishReason.ERROR:
            self._send(ws_error(client_id, from_failed_output(output)))
        else:
            self._send({"type": "done", "id": client_id, "finish_reason": output.finish_reason.value,
                        "usage": output.usage.as_dict(), "timing": output.timings.as_dict()})
        logger.info("ws request %s finish=%s tokens=%d e2e_ms=%.0f", output.request_id,
                    output.finish_reason.value, output.usage.completion_tokens, output.timings.e2e_s * 1000)

    def _send(self, message: dict) -> None:
        if not self.is_open:
            return
        try:
            self.ws.send(json.dumps(message))
        except ConnectionClosed:
            self.is_open = False

    def _close_if_draining(self) -> None:
        if self.state.is_draining and not self.request_ids:
            logger.info("closing an idle socket for shutdown")
            self.ws.close(reason=1001, message="server shutting down")
            self.is_open = False

    def _cancel_all(self) -> None:
        for request_id in list(self.client_ids):
            self.engine.cancel(request_id)


def _client_id(message: dict) -> str:
    client_id = message.get("id")
    if not isinstance(client_id, str) or not client_id or len(client_id) > MAX_ID_LENGTH:
        raise ApiError(400, f"id must be a non-empty string of at most {MAX_ID_LENGTH} characters", "invalid_id",
                       "id")
    return client_id


def _printable_id(client_id):
    return client_id if isinstance(client_id, str) and len(client_id) <= MAX_ID_LENGTH else None


def socket_options(settings) -> dict:
    return {"ping_interval": settings.ws_ping_interval_s, "max_message_size": settings.ws_max_message_bytes}

"""WebSocket /ws: typed JSON frames, several requests per socket told apart by the client's `id`.

The socket, its loop and its close codes are app/sockets.py's; this module is the /ws protocol: generate,
cancel and auth frames in, start, delta, done and error frames out. Closing the socket cancels its running
requests; an error frame leaves the socket usable.
"""
import logging
import uuid

from flask import Blueprint, g
from simple_websocket import Server
from wsproto.frame_protocol import CloseReason

from engine import DeltaEvent, FinishReason, InvalidRequest, RequestOutput, SamplingParams

from .api import client_address
from .choices import chat_logprob_content
from .errors import INVALID_VALUE, ApiError, from_failed_output, invalid_value, missing_field, ws_error
from .guards import keys_match
from .schema import WS_GENERATE, checked_fields, messages_field, prompt_field, sampling_fields
from .sockets import SessionClosing, SocketSession, serve_socket, sock
from .state import AppState

logger = logging.getLogger(__name__)

bp = Blueprint("ws", __name__)

MAX_ID_LENGTH = 128


@sock.route("/ws", bp=bp)
def chat_socket(ws: Server):
    is_authenticated = g.get("is_authenticated", False)
    serve_socket(ws, lambda ws, state: ChatSession(ws, state, client_address(), is_authenticated))


class ChatSession(SocketSession):
    def __init__(self, ws: Server, state: AppState, client: str, is_authenticated: bool):
        super().__init__(ws, state, client, is_authenticated)
        self.client_ids: dict[str, str] = {}  # engine request id -> client id
        self.request_ids: dict[str, str] = {}  # client id -> engine request id
        self.samplings: dict[str, SamplingParams] = {}  # engine request id -> what it asked for (n, logprobs)

    def has_running(self) -> bool:
        return bool(self.request_ids)

    def reference_of(self, message: dict):
        return _printable_id(message.get("id"))

    def engine_reference(self, item):
        return self.client_ids.get(getattr(item, "request_id", None))

    def error_frame(self, reference, error: ApiError) -> dict:
        return ws_error(reference, error)

    def on_engine_event(self, item) -> None:
        match item:
            case DeltaEvent():
                self.send(self._delta_frame(item))
            case RequestOutput():
                self._on_finished(item)

    def on_message(self, message: dict) -> None:
        match message.get("type"):
            case "generate":
                self._start_request(message)
            case "cancel":
                self._cancel(message)
            case "auth":
                self.send({"type": "ready"})
            case other:
                raise ApiError(400, f"unknown message type {other!r}; use generate or cancel", INVALID_VALUE,
                               "type")

    def authenticate(self, message: dict) -> None:
        """The first frame of a socket without a key on its handshake: {"type": "auth", "api_key": "..."}."""
        if message.get("type") != "auth":
            error = ApiError(401, 'authenticate first: {"type": "auth", "api_key": "..."}', "auth_required")
        elif not keys_match(message.get("api_key"), self.settings.api_key):
            error = ApiError(401, "invalid API key", "invalid_api_key")
        else:
            self.is_authenticated = True
            self.send({"type": "ready"})
            return
        self.send(ws_error(None, error))
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
                           client_id=self.client, timeout_s=message.get("timeout"),
                           cache_salt=message.get("cache_salt"))
        self.client_ids[request_id], self.request_ids[client_id] = client_id, request_id
        self.samplings[request_id] = sampling
        self.send({"type": "start", "id": client_id})

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
            self.send(ws_error(client_id, from_failed_output(output)))
        else:
            done = {"type": "done", "id": client_id, "finish_reason": output.finish_reason.value,
                    "usage": output.usage.as_dict(), "timing": output.timings.as_dict()}
            if sampling is not None and sampling.n > 1:
                done["choices"] = [{"index": c.index, "finish_reason": c.finish_reason.value} for c in output.choices]
            self.send(done)
        logger.info("ws request %s finish=%s tokens=%d e2e_ms=%.0f", output.request_id,
                    output.finish_reason.value, output.usage.completion_tokens, output.timings.e2e_s * 1000)

    def cancel_all(self) -> None:
        for request_id in list(self.client_ids):
            self.engine.cancel(request_id)


def _client_id(message: dict) -> str:
    client_id = message.get("id")
    if client_id is None:
        raise missing_field("id")
    if not isinstance(client_id, str) or not client_id or len(client_id) > MAX_ID_LENGTH:
        raise invalid_value("id", f"id must be a non-empty string of at most {MAX_ID_LENGTH} characters")
    return client_id


def _printable_id(client_id):
    return client_id if isinstance(client_id, str) and len(client_id) <= MAX_ID_LENGTH else None

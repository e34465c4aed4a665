"""OpenAI's Responses API in WebSocket mode, `ws://HOST/v1/responses`, as `client.responses.connect()` speaks it.

Client events: `response.create` with the fields of POST /v1/responses, plus `stream_id` (a lane) and
`generate` (false: prepare a conversation to continue, make nothing). Per response the server sends, each
with a `sequence_number` counting from 0 within it: response.created, response.in_progress, then each output
item's events (app/responses/output.py): for the message, response.output_item.added,
response.content_part.added, response.output_text.delta (one per detokenized piece), response.output_text.done,
response.content_part.done, response.output_item.done; for a function call, response.output_item.added,
response.function_call_arguments.delta / .done, response.output_item.done; for the model's reasoning,
response.reasoning_text.delta / .done between its item's added and done; then response.completed or
response.incomplete (response.failed, with the error, if the engine fails it). A request that cannot start gets
an `error` event {type, status, error: {type, code, message, param}}; the socket stays usable.
`response.steer` is refused.

Lanes: responses with the same stream_id (or none) run one after another in the order sent, so a turn may
name the one before it while that still runs; different lanes run at once. At most MAX_WAITING creates wait
per socket (past that: `response_already_in_flight`). The socket remembers its last responses for
previous_response_id (also those with store: false); stored ones resolve anywhere, and are stored from their
start, in progress (a GET shows them so; a DELETE meanwhile wins). Closing the socket cancels its responses and
forgets those still in progress. The socket itself (key from the handshake, origins, socket cap, idle close,
frame limit, drain) is app/sockets/upgrade.py's and app/sockets/session.py's, as for /ws; the route is
app/responses/ws.py.
"""
import json
import logging
import uuid
from collections import deque
from dataclasses import dataclass

from engine import DeltaEvent, EngineError, FinishReason, RequestOutput

from ..errors import INVALID_VALUE, ApiError, invalid_value, unsupported_field
from ..rest.request_parsing import checked_fields, echoable, shown_name
from ..sockets.session import SocketSession
from ..sockets.transport import SocketTransport
from ..state import AppState
from .output import OutputItems
from .rest import RESPONSES, Turn, in_progress_object, parse_turn, remember, response_object
from .store import ResponseStore, StoredResponse

logger = logging.getLogger(__name__)

WS_ONLY_FIELDS = ("type", "stream_id", "generate", "stream")  # the envelope: not part of POST /v1/responses
MAX_LANE_LENGTH = 128
MAX_WAITING = 4  # creates queued behind busy lanes, per socket (each may be a 256 KiB frame)
RECENT_ENTRIES, RECENT_BYTES = 8, 4 << 20  # what a socket remembers of its own responses
MAX_FRAME_BYTES = 1 << 20  # the SDK's (and websockets') default message limit
FINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                "cancelled": "response.incomplete", "failed": "response.failed"}
FRAME_TOO_LARGE = ApiError(500, "this event would be larger than a 1 MiB frame", "frame_too_large",
                           type_="server_error")


@dataclass
class Running:
    """A response on its way: its turn, its lane, the next sequence_number of its events."""

    turn: Turn
    lane: str | None
    items: OutputItems | None = None
    next_number: int = 0

    @property
    def reference(self) -> str | None:
        return self.lane

    def number(self) -> int:
        self.next_number += 1
        return self.next_number - 1


class ResponsesSession(SocketSession):
    streams: dict[str, Running]

    def __init__(self, transport: SocketTransport, state: AppState, client: str):
        # The guards refused a handshake without the key (when the server has one): the socket is authenticated.
        super().__init__(transport, state, client, is_authenticated=True)
        self.waiting: dict[str | None, deque] = {}  # lane -> response.create events waiting for it
        self.recent = ResponseStore(RECENT_ENTRIES, RECENT_BYTES)

    # -- the protocol's hooks -------------------------------------------------------------------------------

    def reference_of(self, message: dict):
        return echoable(message.get("stream_id"), MAX_LANE_LENGTH)

    def error_frame(self, lane, error: ApiError) -> dict:
        frame = {"type": "error", "status": error.status, "error": {
            "type": error.type, "code": error.code, "message": error.message, "param": error.param}}
        if lane is not None:
            frame["stream_id"] = lane
        return frame

    def on_message(self, message: dict) -> None:
        match message.get("type"):
            case "response.create":
                self._create(message)
            case "response.steer":
                raise unsupported_field("type", "response.steer is not supported; send a response.create with "
                                                "previous_response_id")
            case other:
                raise ApiError(400, f"unknown event type {shown_name(str(other))!r}; send response.create",
                               INVALID_VALUE, "type")

    def on_engine_event(self, item) -> None:
        match item:
            case DeltaEvent():
                self._on_delta(item)
            case RequestOutput():
                self._on_finished(item)

    # -- creating ---------------------------------------------------------------------------------------------

    def _create(self, message: dict) -> None:
        lane = _lane(message.get("stream_id"))
        if not self._is_busy(lane):
            self._start(message, lane)
            return
        if sum(len(q) for q in self.waiting.values()) >= MAX_WAITING:
            raise ApiError(409, f"a response is already in flight on this lane and {MAX_WAITING} more wait on "
                                "this socket; wait for one to finish (or use another stream_id)",
                           "response_already_in_flight", "stream_id")
        self.waiting.setdefault(lane, deque()).append(message)

    def _start(self, message: dict, lane: str | None) -> None:
        generate = _flag(message, "generate")
        _flag(message, "stream")  # implicit over a socket: either value streams
        body = checked_fields({k: v for k, v in message.items() if k not in WS_ONLY_FIELDS}, RESPONSES,
                              self.engine.max_model_len)
        turn = parse_turn(body, self.engine, self._find_previous, generate=generate)
        running = Running(turn, lane)
        if not generate:
            self._prepare(running)
            return
        request_id = f"wsr-{uuid.uuid4().hex[:12]}"
        self.engine.submit(None, turn.sampling, messages=turn.messages, request_id=request_id, sink=self.inbox,
                           client_id=self.client, timeout_s=turn.timeout_s, cache_salt=turn.cache_salt,
                           tools=turn.template_tools, thinking=turn.thinking)
        self.streams[request_id] = running
        in_progress = in_progress_object(turn)
        if turn.store:
            self.state.responses.put(StoredResponse.of(in_progress, ()))
        self._emit(running, "response.created", response=in_progress)
        self._emit(running, "response.in_progress", response=in_progress)
        running.items = OutputItems(turn.shape, lambda event_type, **fields: self._emit(running, event_type, **fields))

    def _prepare(self, running: Running) -> None:
        """generate: false: the conversation is kept for a next turn; nothing is made."""
        response = response_object(running.turn, None)
        self._remember(running.turn, response)
        self._emit(running, "response.created", response=in_progress_object(running.turn))
        self._emit(running, "response.completed", response=response)

    def _start_waiting(self, lane: str | None) -> None:
        """The lane is free: start what waits for it (a create that now fails gets its error, the next one runs)."""
        queued = self.waiting.get(lane)
        while queued and not self._is_busy(lane):
            message = queued.popleft()
            try:
                self._start(message, lane)
            except (ApiError, EngineError) as exc:
                self.send_error(lane, exc)
        if not queued:
            self.waiting.pop(lane, None)

    def _is_busy(self, lane: str | None) -> bool:
        return any(running.lane == lane for running in self.streams.values())

    def _find_previous(self, response_id: str) -> StoredResponse | None:
        return self.recent.get(response_id) or self.state.responses.get(response_id)

    # -- streaming and finishing --------------------------------------------------------------------------

    def _on_delta(self, event: DeltaEvent) -> None:
        running = self.streams.get(event.request_id)
        if running is not None:
            running.items.feed(event.text)

    def _on_finished(self, output: RequestOutput) -> None:
        running = self.streams.pop(output.request_id, None)
        if running is None:
            return
        items = running.items.finish(output) if output.finish_reason is not FinishReason.ERROR else None
        response = response_object(running.turn, output, items)
        self._remember(running.turn, response, started=True)  # first: a GET on the final event finds it final
        self._emit(running, FINAL_EVENTS[response["status"]], response=response)
        logger.info("ws response %s finish=%s tokens=%d e2e_ms=%.0f", running.turn.response_id,
                    output.finish_reason.value, output.usage.completion_tokens, output.timings.e2e_s * 1000)
        self._start_waiting(running.lane)

    def _emit(self, running: Running, event_type: str, **fields) -> None:
        event = {"type": event_type, "sequence_number": running.number(), **fields}
        if running.lane is not None:
            event["stream_id"] = running.lane
        text = json.dumps(event)
        if len(text) > MAX_FRAME_BYTES:  # ASCII (json escapes the rest): characters are bytes
            logger.warning("response %s: a %s event of %d bytes replaced by an error", running.turn.response_id,
                           event_type, len(text))
            text = json.dumps({**self.error_frame(running.lane, FRAME_TOO_LARGE), "sequence_number": event[
                "sequence_number"]})
        self.transport.send_text(text)

    def _remember(self, turn: Turn, response: dict, started: bool = False) -> None:
        shared = [self.state.responses] if turn.store else []
        if started:  # the server's store has held it in progress since it started
            remember(turn, response, [self.recent], completes=shared)
        else:
            remember(turn, response, [self.recent, *shared])

    def cancel_all(self) -> None:
        """The socket closes: its responses are cancelled, and those stored in progress forgotten (as a REST
        client's that closes its connection are never stored)."""
        super().cancel_all()
        for running in self.streams.values():
            if running.turn.store:
                self.state.responses.delete(running.turn.response_id)


def _lane(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_LANE_LENGTH:
        raise invalid_value("stream_id", f"stream_id must be a non-empty string of at most {MAX_LANE_LENGTH} "
                                         "characters")
    return value


def _flag(message: dict, name: str) -> bool:
    value = message.get(name)
    if value is None:
        return True
    if not isinstance(value, bool):
        raise invalid_value(name, f"{name} must be true or false")
    return value

"""The /ws protocol: typed JSON frames, several streams per socket told apart by the client's `id`.

Frames in: generate, cancel, auth. Frames out: start, delta, done, error. Each generate frame that starts
becomes a ChatStream, the session's one record of it, from `start` to its `done` (or error) frame. Closing the
socket cancels its running streams; an error frame leaves the socket usable.

A chat with tools, or on a template with a reasoning block, streams its answer taken apart
(engine/answer_stream.py): a delta's `text` is the answer's, `reasoning` the model's thinking, `tool_calls` the
calls as they form (OpenAI's chunk shape); the done frame lists the finished calls.
"""
import logging
import uuid
from dataclasses import dataclass, field

from wsproto.frame_protocol import CloseReason

from engine import DeltaEvent, FinishReason, InvalidRequest, RequestOutput, SamplingParams
from engine.answer_stream import AnswerShape, AnswerSplitter

from ..errors import (AUTH_REQUIRED, INVALID_API_KEY, INVALID_VALUE, ApiError, from_failed_output, invalid_value,
                      missing_field, ws_error)
from ..guards import keys_match
from ..rest.answer_shaping import call_object, calls_finish_reason, chat_logprob_content, streamed_parts
from ..rest.chat_request import chat_request
from ..rest.request_parsing import WS_GENERATE, checked_fields, echoable, prompt_field, sampling_fields
from .session import SessionClosing, SocketSession

logger = logging.getLogger(__name__)

MAX_ID_LENGTH = 128


@dataclass(frozen=True)
class ChatStream:
    """One running generate frame: the client's id for it, the engine's, and what it asked for."""

    client_id: str
    request_id: str
    sampling: SamplingParams
    shape: AnswerShape | None = None  # a chat's: what to take apart in its answer
    splitters: dict[int, AnswerSplitter] = field(default_factory=dict)  # sample index -> its answer's splitter

    @property
    def reference(self) -> str:
        return self.client_id

    def splitter(self, index: int) -> AnswerSplitter | None:
        if self.shape is None or self.shape.is_plain:
            return None
        return self.splitters.setdefault(index, AnswerSplitter(self.shape))

    @property
    def has_samples(self) -> bool:
        """n > 1: its deltas carry their sample's `index`, its done frame the samples' finish reasons."""
        return self.sampling.n > 1

    @property
    def has_logprobs(self) -> bool:
        return self.sampling.logprobs is not None


class ChatSession(SocketSession):
    streams: dict[str, ChatStream]

    def reference_of(self, message: dict):
        return echoable(message.get("id"), MAX_ID_LENGTH)

    def error_frame(self, reference, error: ApiError) -> dict:
        return ws_error(reference, error)

    def on_engine_event(self, item) -> None:
        match item:
            case DeltaEvent():
                if (frame := self._delta_frame(item)) is not None:
                    self.transport.send(frame)
            case RequestOutput():
                self._on_finished(item)

    def on_message(self, message: dict) -> None:
        match message.get("type"):
            case "generate":
                self._start(message)
            case "cancel":
                self._cancel(message)
            case "auth":
                self.transport.send({"type": "ready"})
            case other:
                raise ApiError(400, f"unknown message type {other!r}; use generate or cancel", INVALID_VALUE,
                               "type")

    def authenticate(self, message: dict) -> None:
        """The first frame of a socket without a key on its handshake: {"type": "auth", "api_key": "..."}."""
        if message.get("type") != "auth":
            error = ApiError(401, 'authenticate first: {"type": "auth", "api_key": "..."}', AUTH_REQUIRED)
        elif not keys_match(message.get("api_key"), self.settings.api_key):
            error = ApiError(401, "invalid API key", INVALID_API_KEY)
        else:
            self.is_authenticated = True
            self.transport.send({"type": "ready"})
            return
        self.transport.send(ws_error(None, error))
        raise SessionClosing(CloseReason.POLICY_VIOLATION, error.message)

    # -- a stream's life ------------------------------------------------------------------------------------

    def _start(self, message: dict) -> None:
        client_id = _client_id(message)
        if self._stream_of(client_id) is not None:
            raise ApiError(409, f"a request with id {client_id!r} is already running on this socket", "duplicate_id",
                           "id")
        message = checked_fields(message, WS_GENERATE)
        if "messages" in message:
            chat = chat_request(message, self.engine)
            prompt, messages, sampling, shape = None, chat.messages, chat.sampling, chat.shape
            template = {"tools": chat.template_tools, "thinking": chat.thinking}
        else:
            for name in ("tools", "tool_choice", "chat_template_kwargs"):
                if message.get(name) is not None:
                    raise invalid_value(name, f"{name} goes with messages (a chat), not with a prompt")
            prompt, messages, sampling, shape = prompt_field(message), None, sampling_fields(message, self.engine), None
            template = {}
        if sampling.num_samples > sampling.n:
            raise InvalidRequest("best_of cannot be streamed (the samples not returned would be); use REST",
                                 "best_of")
        request_id = f"ws-{uuid.uuid4().hex[:12]}"
        self.engine.submit(prompt, sampling, messages=messages, request_id=request_id, sink=self.inbox,
                           client_id=self.client, timeout_s=message.get("timeout"),
                           cache_salt=message.get("cache_salt"), **template)
        self.streams[request_id] = ChatStream(client_id, request_id, sampling, shape)
        self.transport.send({"type": "start", "id": client_id})

    def _delta_frame(self, event: DeltaEvent) -> dict | None:
        """`index` with n > 1; `logprobs` (chat's content entries, for the tokens since the last delta) when asked.
        None when the splitter holds all of it back (text that may be the start of markup) and nothing else is due."""
        stream = self.streams.get(event.request_id)
        splitter = stream.splitter(event.index) if stream is not None else None
        fields = streamed_parts(splitter.feed(event.text)) if splitter is not None else {"text": event.text}
        if stream is not None and stream.has_logprobs:
            fields["logprobs"] = chat_logprob_content(event.logprobs, self.engine.token_texts)
        elif fields == {"text": ""}:
            return None
        return self._frame(stream, event.index, fields)

    def _frame(self, stream: ChatStream | None, index: int, fields: dict) -> dict:
        frame = {"type": "delta", "id": stream.client_id if stream else None, **fields}
        if stream is not None and stream.has_samples:
            frame["index"] = index
        return frame

    def _cancel(self, message: dict) -> None:
        client_id = _client_id(message)
        stream = self._stream_of(client_id)
        if stream is None:
            raise ApiError(404, f"no running request with id {client_id!r}", "unknown_id", "id")
        self.engine.cancel(stream.request_id)  # its `done` (finish_reason abort) follows from the engine

    def _on_finished(self, output: RequestOutput) -> None:
        stream = self.streams.pop(output.request_id, None)
        client_id = stream.client_id if stream else None
        if output.finish_reason is FinishReason.ERROR:
            self.transport.send(ws_error(client_id, from_failed_output(output)))
        else:
            finish_reasons = self._finish_split_answers(stream, output)
            done = {"type": "done", "id": client_id, "finish_reason": finish_reasons[0][0],
                    "usage": output.usage.as_dict(), "timing": output.timings.as_dict()}
            if finish_reasons[0][1]:
                done["tool_calls"] = finish_reasons[0][1]
            if stream is not None and stream.has_samples:
                done["choices"] = [{"index": c.index, "finish_reason": reason, **({"tool_calls": calls} if calls
                                                                                  else {})}
                                   for c, (reason, calls) in zip(output.choices, finish_reasons)]
            self.transport.send(done)
        logger.info("ws request %s finish=%s tokens=%d e2e_ms=%.0f", output.request_id,
                    output.finish_reason.value, output.usage.completion_tokens, output.timings.e2e_s * 1000)

    def _finish_split_answers(self, stream: ChatStream | None, output: RequestOutput) -> list[tuple[str, list]]:
        """Each sample's last held-back parts sent; its finish reason ("tool_calls" when it ended with calls) and
        its calls."""
        reasons = []
        for choice in output.choices:
            splitter = stream.splitter(choice.index) if stream is not None else None
            if splitter is None:
                reasons.append((choice.finish_reason.value, []))
                continue
            tail = streamed_parts(splitter.finish())
            if tail != {"text": ""}:
                self.transport.send(self._frame(stream, choice.index, tail))
            answer = splitter.result()
            reasons.append((calls_finish_reason(choice.finish_reason.value, answer),
                            [call_object(call) for call in answer.calls]))
        return reasons

    def _stream_of(self, client_id: str) -> ChatStream | None:
        return next((stream for stream in self.streams.values() if stream.client_id == client_id), None)


def _client_id(message: dict) -> str:
    client_id = message.get("id")
    if client_id is None:
        raise missing_field("id")
    if not isinstance(client_id, str) or not client_id or len(client_id) > MAX_ID_LENGTH:
        raise invalid_value("id", f"id must be a non-empty string of at most {MAX_ID_LENGTH} characters")
    return client_id



"""Run one fuzz case against a live server and judge what came back on the wire.

Every case ends in a CaseResult: an `observed` outcome (an HTTP status, a close code, "usable" for a socket that
still answers) and a list of problems. A problem is something the API contract rules out: a 5xx, an
error body without the JSON error shape, a socket closed without a close code, a socket that stops answering
after an error frame, the wrong close code for a protocol error.
"""
import json
import socket
import time
from dataclasses import dataclass, field
from typing import Callable

import websocket

from .fuzzcases import RawCase, RestCase, WsFrame, WsSession, encode_body
from .load import (ERROR_KEYS, RESPONSES_FINAL, close_quietly, has_error_shape, http_call, responses_ws_url,
                   ws_connect, ws_read_until)

REST_TIMEOUT_S = 120.0
WS_TIMEOUT_S = 120.0
CLOSE_WAIT_S = 15.0  # a socket that must be closed by the server gets this long to do it
WS_MAX_MESSAGE_BYTES = 256 << 10  # the server's documented frame limit (close 1009 above it)
RAW_TIMEOUT_S = 10.0
PROBE_ID = "__probe__"
SERVER_FAULT_CODES = {"worker_failed", "internal_error", "server_error", "not_ready"}
SUCCESS_KEYS = {"/basic_generate": "generated_text", "/generate": "generated_texts", "/v1/completions": "choices",
                "/v1/chat/completions": "choices", "/tokenize": "tokens", "/v1/responses": "output"}
# The contract's four, plus "ready": the answer to an auth frame (the socket's key is not in its URL).
WS_MESSAGE_TYPES = {"start", "delta", "done", "error", "ready"}
RESPONSES_EVENT_TYPES = {"response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                         "response.content_part.done", "response.output_item.done", *RESPONSES_FINAL, "error"}
FRAME_TYPES = ("generate", "cancel", "auth", "response.create", "response.steer")


@dataclass
class CaseResult:
    surface: str
    target: str
    observed: str
    description: str
    problems: list = field(default_factory=list)  # (kind, detail)
    is_5xx: bool = False
    closed_without_code: bool = False
    error_codes: list = field(default_factory=list)  # codes of WS error frames

    def problem(self, kind: str, detail: str = "") -> None:
        self.problems.append((kind, detail))


# -- REST ---------------------------------------------------------------------------------------------------------

def run_rest(host: str, port: int, case: RestCase, mutations=None) -> CaseResult:
    headers = {"Content-Type": case.content_type} if case.content_type else {}
    outcome = http_call(host, port, case.method, case.path, case.body_bytes(mutations), headers, REST_TIMEOUT_S)
    result = CaseResult("rest", f"{case.method} {case.path}", str(outcome.status or outcome.failure),
                        case.describe(mutations))
    if outcome.status is None:
        result.problem("rest_no_response", outcome.failure)
        return result
    result.is_5xx = outcome.status >= 500
    if result.is_5xx:
        result.problem("rest_5xx", outcome.body[:300].decode("utf-8", "replace"))
    if outcome.status >= 400 and case.method != "HEAD" and not has_error_shape(outcome.json()):
        result.problem("rest_error_shape", f"{outcome.content_type}: {outcome.body[:200]!r}")
    _check_success_shape(case, outcome, result)
    if outcome.status == 200 and case.method == "POST":
        _check_new_fields(case.body(mutations), case.path, outcome.json(), result)
    return result


def _check_success_shape(case: RestCase, outcome, result: CaseResult) -> None:
    key = SUCCESS_KEYS.get(case.path)
    if outcome.status == 200 and case.method == "POST" and key and key not in (outcome.json() or {}):
        result.problem("rest_success_shape", repr(outcome.body[:200]))


def _check_new_fields(body, path: str, answer, result: CaseResult) -> None:
    """An accepted request got what its sampling and output fields asked for: n choices per prompt, logprobs when asked,
    the prompt echoed. A field accepted and then not honoured is `rest_field_ignored`."""
    if not isinstance(body, dict) or not isinstance(answer, dict):
        return
    choices = answer.get("choices")
    if path in ("/v1/completions", "/v1/chat/completions") and isinstance(choices, list):
        n = body.get("n")
        prompts = body.get("prompt") if path == "/v1/completions" else None
        count = len(prompts) if isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list)) else 1
        if _is_count(n) and len(choices) != n * count:
            result.problem("rest_field_ignored", f"n={n} x {count} prompt(s) answered {len(choices)} choices")
        if _asks_logprobs(body, path) and any(c.get("logprobs") is None for c in choices if isinstance(c, dict)):
            result.problem("rest_field_ignored", "logprobs asked for, a choice has logprobs null")
    if body.get("echo") is True and isinstance(body.get("prompt"), str):
        texts = [c.get("text") for c in choices if isinstance(c, dict)] if isinstance(choices, list) \
            else [answer.get("generated_text")]
        if path in ("/v1/completions", "/basic_generate") and not all(
                isinstance(t, str) and t.startswith(body["prompt"]) for t in texts):
            result.problem("rest_field_ignored", f"echo: true, an answer does not start with the prompt: {texts!r:.80}")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _asks_logprobs(body: dict, path: str) -> bool:
    logprobs = body.get("logprobs")
    if path == "/v1/chat/completions":
        return logprobs is True
    return isinstance(logprobs, int) and not isinstance(logprobs, bool)


# -- WebSocket ----------------------------------------------------------------------------------------------------

def run_ws(url: str, session: WsSession) -> CaseResult:
    """`url` is the server's /ws; a Responses session goes to /v1/responses beside it."""
    protocol = PROTOCOLS[session.protocol]
    result = CaseResult(protocol.surface, " + ".join(f.kind if f.kind != "text" else _frame_type(f)
                                                     for f in session.frames), "", session.describe())
    try:
        ws = ws_connect(protocol.url_of(url), timeout=30)
    except (OSError, websocket.WebSocketException) as exc:
        result.observed = "handshake failed"
        result.problem("ws_handshake_failed", repr(exc))
        return result
    try:
        _run_session(ws, session, protocol, result)
    finally:
        close_quietly(ws)
    return result


def _frame_type(frame: WsFrame) -> str:
    payload = frame.payload
    kind = payload.get("type") if isinstance(payload, dict) else None
    return kind if kind in FRAME_TYPES else "other"


def _run_session(ws, session: WsSession, protocol: "SocketProtocol", result: CaseResult) -> None:
    frames = _frames_until_close(session.frames)
    expected_close = _expected_close(frames[-1])
    send_failed = _send_frames(ws, frames)
    if expected_close is None and not send_failed:
        send_failed = _send_frames(ws, [WsFrame("text", protocol.probe)])
    tracker = protocol.tracker(expect_probe=expected_close is None and not send_failed)
    read = ws_read_until(ws, tracker.is_complete, WS_TIMEOUT_S if tracker.expect_probe else CLOSE_WAIT_S)
    protocol.check_messages(read.messages, result)
    _judge_session(read, tracker, expected_close, send_failed, result)


def _expected_close(frame: WsFrame) -> int | None:
    """The close code a frame must get: its own, or 1009 for a text frame over the server's size limit."""
    if frame.expect_close:
        return frame.expect_close
    if frame.kind in ("text", "raw_text"):
        data = _frame_bytes(frame)
        if len(data) > WS_MAX_MESSAGE_BYTES:
            return 1009
        if not _is_utf8(data):
            return 1007
    return None


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _frames_until_close(frames: list) -> list:
    for index, frame in enumerate(frames):
        if _expected_close(frame):
            return frames[:index + 1]
    return frames


def _frame_bytes(frame: WsFrame) -> bytes:
    if frame.kind == "raw_text":
        return frame.payload.encode("utf-8", "surrogatepass")
    return encode_body(frame.payload)


def _send_frames(ws, frames) -> bool:
    """Send every frame; True if the server cut the connection while we were still sending."""
    try:
        for frame in frames:
            _send_frame(ws, frame)
    except (OSError, websocket.WebSocketException):
        return True
    return False


def _send_frame(ws, frame: WsFrame) -> None:
    abnf = websocket.ABNF
    match frame.kind:
        case "text" | "raw_text":
            ws.send(_frame_bytes(frame), opcode=abnf.OPCODE_TEXT)
        case "bytes_text":
            ws.send(frame.payload, opcode=abnf.OPCODE_TEXT)
        case "binary":
            ws.send(frame.payload, opcode=abnf.OPCODE_BINARY)
        case "ping":
            ws.ping(frame.payload)
        case "pong":
            ws.pong(frame.payload)
        case "cont":
            ws.send_frame(abnf.create_frame(frame.payload, abnf.OPCODE_CONT, fin=1))
        case "fragmented":
            ws.send_frame(abnf.create_frame(frame.payload[:10], abnf.OPCODE_TEXT, fin=0))
            ws.send_frame(abnf.create_frame(frame.payload[10:], abnf.OPCODE_CONT, fin=1))
        case "burst":
            for i in range(30):
                ws.send(json.dumps({"type": "nope", "id": f"burst{i}"}))


class _SessionTracker:
    """Done when the probe's error has come back and every request that started has finished."""

    def __init__(self, expect_probe: bool):
        self.expect_probe = expect_probe
        self.probe_answered = False
        self.running: set = set()

    def is_complete(self, message: dict) -> bool:
        kind, request_id = message.get("type"), message.get("id")
        if kind == "start":
            self.running.add(request_id)
        elif kind in ("done", "error"):
            self.running.discard(request_id)
            self.probe_answered |= request_id == PROBE_ID
        return self._is_done()

    def _is_done(self) -> bool:
        return self.probe_answered and not self.running if self.expect_probe else False


class _ResponsesTracker(_SessionTracker):
    """The same for /v1/responses: a response runs from response.created to its final event; the probe's error
    names its lane (stream_id)."""

    def is_complete(self, message: dict) -> bool:
        kind, response = message.get("type"), message.get("response")
        response_id = response.get("id") if isinstance(response, dict) else None
        if kind == "response.created":
            self.running.add(response_id)
        elif kind in RESPONSES_FINAL:
            self.running.discard(response_id)
        elif kind == "error":
            self.probe_answered |= message.get("stream_id") == PROBE_ID
        return self._is_done()


def _judge_session(read, tracker: _SessionTracker, expected_close, send_failed: bool, result: CaseResult) -> None:
    if read.ended == "close":
        result.observed = f"close {read.close_code}"
        if expected_close is None:
            result.problem("ws_closed_after_text_frame", f"close code {read.close_code}")
        elif read.close_code != expected_close:
            result.problem("ws_wrong_close_code", f"expected {expected_close}, got {read.close_code}")
    elif read.ended == "timeout" and tracker.expect_probe and tracker.probe_answered and tracker.running:
        result.observed = "usable, request unfinished"
        result.problem("ws_request_unfinished", f"no done for {sorted(map(str, tracker.running))}")
    elif read.ended == "timeout" and tracker.expect_probe and not tracker.probe_answered:
        result.observed = "unresponsive"
        result.problem("ws_unresponsive", "the probe got no answer")
    elif read.ended == "timeout" and expected_close:
        result.observed = "not closed"
        result.problem("ws_not_closed", f"expected close {expected_close}; the socket stayed open")
    elif read.ended is None or (read.ended == "timeout" and tracker.probe_answered):
        result.observed = "usable"
    else:
        result.observed = f"ended: {read.ended}" + (" (while sending)" if send_failed else "")
        result.closed_without_code = True
        result.problem("ws_closed_without_code", f"{read.ended}; expected close {expected_close or '(none)'}")


def _check_messages(messages: list, result: CaseResult, known_types=WS_MESSAGE_TYPES, check_error=None) -> None:
    """Every message is of a type the protocol has, every error well-shaped; a failed response is no server fault."""
    for message in messages:
        kind = message.get("type") if isinstance(message, dict) else None
        if kind not in known_types:
            result.problem("ws_unknown_message", repr(message)[:200])
        elif kind == "error":
            (check_error or _check_error_frame)(message, result)
        elif kind == "response.failed" and _failure_code(message) in SERVER_FAULT_CODES:
            result.problem("ws_server_fault", f"response.failed: {str(message.get('response'))[:200]}")


def _check_error_frame(message: dict, result: CaseResult) -> None:
    code = message.get("code")
    result.error_codes.append(str(code))
    if not {"id", "code", "message"} <= set(message) or not isinstance(code, str):
        result.problem("ws_error_shape", repr(message)[:200])
    if code in SERVER_FAULT_CODES and message.get("id") != PROBE_ID:
        result.problem("ws_server_fault", f"{code}: {str(message.get('message'))[:200]}")


def _check_responses_error(message: dict, result: CaseResult) -> None:
    """{"type": "error", "status", "error": {"type", "code", "message", "param"}}, as OpenAI sends it."""
    error = message.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    result.error_codes.append(str(code))
    if not isinstance(error, dict) or not ERROR_KEYS <= set(error) or not isinstance(code, str) \
            or not isinstance(message.get("status"), int):
        result.problem("ws_error_shape", repr(message)[:200])
    if code in SERVER_FAULT_CODES and message.get("stream_id") != PROBE_ID:
        result.problem("ws_server_fault", f"{code}: {str(error.get('message'))[:200]}")


def _failure_code(message: dict):
    response = message.get("response")
    error = response.get("error") if isinstance(response, dict) else None
    return error.get("code") if isinstance(error, dict) else None


@dataclass(frozen=True)
class SocketProtocol:
    """What a fuzz session needs to know of a socket protocol: where, its probe, how to follow and check it."""
    surface: str
    url_of: Callable[[str], str]  # from the server's /ws URL
    probe: dict  # a frame that must get an error naming PROBE_ID, and leaves the socket usable
    tracker: type
    check_messages: Callable[[list, CaseResult], None]


PROTOCOLS = {
    "ws": SocketProtocol("ws", lambda url: url, {"type": "cancel", "id": PROBE_ID}, _SessionTracker,
                         _check_messages),
    "responses": SocketProtocol("responses_ws", responses_ws_url, {"type": "response.probe", "stream_id": PROBE_ID},
                                _ResponsesTracker, lambda messages, result: _check_messages(
                                    messages, result, RESPONSES_EVENT_TYPES, _check_responses_error)),
}


# -- raw HTTP -----------------------------------------------------------------------------------------------------

def run_raw(host: str, port: int, case: RawCase) -> CaseResult:
    result = CaseResult("raw", case.name, "", f"{case.name} (expected {case.expect})")
    try:
        sock = socket.create_connection((host, port), timeout=RAW_TIMEOUT_S)
    except OSError as exc:
        result.observed = "connect failed"
        result.problem("raw_connect_failed", repr(exc))
        return result
    with sock:
        send_error = _send_raw(sock, case)
        data, ending = _read_raw(sock, case.responses, case.wait_s)
    responses = parse_responses(data)
    _judge_raw(case, responses, ending, send_error, result)
    return result


def _send_raw(sock: socket.socket, case: RawCase) -> str | None:
    try:
        for data, delay_s in case.chunks:
            if delay_s:
                time.sleep(delay_s)  # the case *is* a slow client
            sock.sendall(data)
        if case.half_close:
            sock.shutdown(socket.SHUT_WR)
    except OSError as exc:
        return type(exc).__name__
    return None


def _read_raw(sock: socket.socket, wanted: int, wait_s: float) -> tuple[bytes, str]:
    data = b""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, socket.timeout):
            return data, "timeout"
        except OSError:
            return data, "reset"
        if not chunk:
            return data, "eof"
        data += chunk
        responses = parse_responses(data)
        if len(responses) >= wanted and (responses[-1][0] == 101 or responses[-1][3]):
            return data, "complete"
    return data, "timeout"


def parse_responses(data: bytes) -> list:
    """[(status, headers, body, complete)] for each response in `data` (interim 100s skipped)."""
    responses, position = [], 0
    while True:
        head_end = data.find(b"\r\n\r\n", position)
        if head_end < 0:
            return responses
        status, headers = _parse_head(data[position:head_end])
        if status is None:
            return responses
        body_start = head_end + 4
        if status == 100:
            position = body_start
            continue
        length = int(headers.get("content-length", "-1") or -1) if headers.get("content-length", "").isdigit() else -1
        if status == 101 or length < 0:
            responses.append((status, headers, data[body_start:], status == 101))
            return responses
        responses.append((status, headers, data[body_start:body_start + length],
                          len(data) >= body_start + length))
        position = body_start + length


def _parse_head(head: bytes) -> tuple[int | None, dict]:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        return None, {}
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


def _judge_raw(case: RawCase, responses: list, ending: str, send_error: str | None, result: CaseResult) -> None:
    if not responses:
        result.observed = f"no response ({ending}{', send ' + send_error if send_error else ''})"
        if "close" not in case.expect:
            result.problem("raw_no_response", f"{ending}; expected {case.expect}")
        return
    result.observed = ", ".join(str(status) for status, *_ in responses)
    for status, headers, body, _ in responses:
        _judge_raw_response(case, status, headers, body, result)
    if len(responses) < case.responses and responses[-1][1].get("connection", "").lower() != "close":
        # a response that says "Connection: close" ends the exchange, as HTTP allows (e.g. after a 413)
        result.problem("raw_missing_response", f"{len(responses)} of {case.responses} responses ({ending}); "
                                               f"expected {case.expect}")


def _judge_raw_response(case: RawCase, status: int, headers: dict, body: bytes, result: CaseResult) -> None:
    if status >= 500:
        result.is_5xx = True
        result.problem("raw_5xx", f"{status} {body[:200]!r}; expected {case.expect}")
    elif status >= 400 and not _is_json_error(headers, body):
        result.problem("raw_non_json_error", f"{status} {headers.get('content-type', '')}: {body[:80]!r}")
    if status == 101 and "101" not in case.expect and "200" not in case.expect:
        result.problem("raw_unexpected_upgrade", f"upgraded; expected {case.expect}")


def _is_json_error(headers: dict, body: bytes) -> bool:
    try:
        return has_error_shape(json.loads(body))
    except ValueError:
        return False

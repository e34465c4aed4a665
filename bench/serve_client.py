"""One request to one server over its own protocol, timed as vLLM's benchmark times it (RequestFuncOutput): the
start, the arrival of the first piece of text (TTFT), the gaps between later pieces (ITL), the end (E2E latency),
and the text received. A piece is a WebSocket `delta` frame or an SSE chunk with non-empty text.

Three protocols, each callable from many threads at once (every thread keeps its own connection):
- `LockstepWebSocket`: lockstep's streaming API, /ws (one socket per client thread, reused, like keep-alive);
- `LockstepRest`: lockstep's /v1/completions, which does not stream: TTFT, TPOT and ITL are not observable;
- `OpenAiCompletions`: any OpenAI-compatible server's streaming /v1/completions (vLLM's, llama.cpp's, ...).
"""
import http.client
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import websocket

from .serve_data import RequestSpec
from .sse import DONE, iter_event_data, split_lines

logger = logging.getLogger(__name__)

EOS_METHODS = ("field", "logit-bias", "none")  # how `ignore_eos` is asked for (see `Sampling`)
BANNED_LOGIT_BIAS = -100  # OpenAI's logit_bias range is [-100, 100]; -100 bans a token
READ_CHUNK_BYTES = 65536
REUSE_IDLE_S = 10.0  # lockstep pings every 25 s and closes a socket that missed the previous pong
CLOSE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class Sampling:
    """The sampling fields every request of a run carries. `ignore_eos` makes each request produce its full output
    length: lockstep and vLLM take `"ignore_eos": true` (eos_method "field"); llama.cpp's server has no such
    field, so its end-of-generation tokens are banned with `logit_bias` instead ("logit-bias", `banned_token_ids`)."""
    temperature: float = 0.0
    ignore_eos: bool = True
    eos_method: str = "field"
    banned_token_ids: tuple[int, ...] = ()
    include_usage: bool = False  # ask an OpenAI server for a final usage chunk (vLLM supports stream_options)

    @classmethod
    def greedy(cls, tokenizer, eos_method: str) -> "Sampling":
        """What `bench compare` asks of every server: greedy, ignore_eos by the server's own method."""
        return cls(temperature=0.0, ignore_eos=True, eos_method=eos_method,
                   banned_token_ids=tuple(sorted(tokenizer.all_special_ids)))

    def body_fields(self) -> dict:
        fields = {"temperature": self.temperature}
        if self.ignore_eos and self.eos_method == "field":
            fields["ignore_eos"] = True
        if self.ignore_eos and self.eos_method == "logit-bias":
            fields["logit_bias"] = {str(token_id): BANNED_LOGIT_BIAS for token_id in self.banned_token_ids}
        return fields


@dataclass
class RequestResult:
    index: int
    success: bool = False
    generated_text: str = ""
    start_time: float = 0.0  # time.perf_counter() when the request started
    ttft_s: float | None = None  # None: nothing streamed (REST) or nothing arrived
    itl_s: list[float] = field(default_factory=list)
    latency_s: float = 0.0
    is_streaming: bool = True
    server_output_tokens: int | None = None  # the server's own usage count, where it reports one
    finish_reason: str | None = None
    error: str = ""


OnFirstText = Callable[[], None] | None  # called (on the sending thread) when a request's first text arrives


class _Stopwatch:
    """Timestamps pieces of text as they arrive into a RequestResult."""

    def __init__(self, result: RequestResult, on_first_text: OnFirstText = None):
        self.result = result
        self.on_first_text = on_first_text
        self.result.start_time = self.last = time.perf_counter()

    def piece(self, text: str) -> None:
        if not text:
            return
        now = time.perf_counter()
        if self.result.ttft_s is None:
            self.result.ttft_s = now - self.result.start_time
            if self.on_first_text is not None:
                self.on_first_text()
        else:
            self.result.itl_s.append(now - self.last)
        self.last = now
        self.result.generated_text += text

    def stop(self) -> None:
        self.result.latency_s = time.perf_counter() - self.result.start_time


class LockstepWebSocket:
    api = "lockstep-ws"

    def __init__(self, base_url: str, timeout_s: float = 600.0, api_key: str = ""):
        parts = urlsplit(base_url)
        self.ws_url = f"{'wss' if parts.scheme == 'https' else 'ws'}://{parts.netloc}/ws"
        self.timeout_s = timeout_s
        self.headers = _auth_headers(api_key)
        self._local = threading.local()
        self._idle_since: dict[websocket.WebSocket, float | None] = {}  # every open socket; None while in use
        self._lock = threading.Lock()

    def send(self, spec: RequestSpec, sampling: Sampling, on_first_text: OnFirstText = None) -> RequestResult:
        result = RequestResult(spec.index)
        frame = json.dumps({"type": "generate", "id": str(spec.index), "prompt": spec.prompt,
                            "max_tokens": spec.output_len, **sampling.body_fields()})
        stopwatch = _Stopwatch(result, on_first_text)
        try:
            ws = self._socket_for_request()
            ws.send(frame)
            self._read_until_finished(ws, stopwatch)
            self._mark_idle(ws)
        except (websocket.WebSocketException, OSError, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            self._drop_socket()  # frames of the failed request may still come; cancel it by closing
        stopwatch.stop()
        return result

    def close(self) -> None:
        with self._lock:
            sockets, self._idle_since = self._idle_since, {}
        for ws, idle_since in sockets.items():
            _close_socket(ws, idle_since)

    def abort(self) -> None:
        """End every request still running, from another thread: their sockets are shut down under them (which
        the server takes as a cancel)."""
        with self._lock:
            sockets = list(self._idle_since)
        for ws in sockets:
            _shut_down(ws.sock)

    def _socket_for_request(self) -> websocket.WebSocket:
        """This thread's socket, kept between its requests like an HTTP keep-alive; one idle for longer than
        REUSE_IDLE_S is replaced (nothing reads it while idle, so it answers no pings, and the server closes a
        socket that misses one)."""
        ws = getattr(self._local, "ws", None)
        with self._lock:
            idle_since = self._idle_since.get(ws)
            if ws is not None and idle_since is not None and time.monotonic() - idle_since < REUSE_IDLE_S:
                self._idle_since[ws] = None
                return ws
        self._drop_socket()
        ws = websocket.create_connection(self.ws_url, timeout=self.timeout_s,
                                         header=[f"{k}: {v}" for k, v in self.headers.items()])
        self._local.ws = ws
        with self._lock:
            self._idle_since[ws] = None
        return ws

    def _mark_idle(self, ws: websocket.WebSocket) -> None:
        with self._lock:
            if ws in self._idle_since:
                self._idle_since[ws] = time.monotonic()

    def _drop_socket(self) -> None:
        ws = getattr(self._local, "ws", None)
        self._local.ws = None
        if ws is not None:
            with self._lock:
                idle_since = self._idle_since.pop(ws, None)
            _close_socket(ws, idle_since)

    @staticmethod
    def _read_until_finished(ws: websocket.WebSocket, stopwatch: _Stopwatch) -> None:
        result = stopwatch.result
        while True:
            message = json.loads(ws.recv())
            match message.get("type"):
                case "delta":
                    stopwatch.piece(message.get("text", ""))
                case "done":
                    result.success = True
                    result.finish_reason = message.get("finish_reason")
                    result.server_output_tokens = (message.get("usage") or {}).get("completion_tokens")
                    return
                case "error":
                    result.error = f"{message.get('code')}: {message.get('message')}"
                    return


def _close_socket(ws: websocket.WebSocket, idle_since: float | None) -> None:
    """A close handshake, unless the socket sat idle so long that the server has closed it already (then reading its
    close frame would only log the server's 1008 "ping timeout")."""
    try:
        if idle_since is not None and time.monotonic() - idle_since >= REUSE_IDLE_S:
            ws.shutdown()
        else:
            ws.close(timeout=CLOSE_TIMEOUT_S)
    except (websocket.WebSocketException, OSError):  # already shut down (an aborted request)
        ws.shutdown()


def _shut_down(sock: socket.socket | None) -> None:
    """Wake a thread blocked reading `sock` (closing the descriptor alone would not)."""
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed
        pass


class _HttpTarget:
    """Shared by the HTTP protocols: one fresh connection per request (loopback connects cost ~0.1 ms)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, api_key: str = ""):
        parts = urlsplit(base_url)
        self.host, self.port, self.is_https = parts.hostname, parts.port, parts.scheme == "https"
        self.timeout_s = timeout_s
        self.headers = {"Content-Type": "application/json", **_auth_headers(api_key)}
        self._open: set[http.client.HTTPConnection] = set()
        self._lock = threading.Lock()

    def _post(self, path: str, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        connection_class = http.client.HTTPSConnection if self.is_https else http.client.HTTPConnection
        connection = connection_class(self.host, self.port, timeout=self.timeout_s)
        with self._lock:
            self._open.add(connection)
        try:
            connection.request("POST", path, json.dumps(body), self.headers)
            return connection, connection.getresponse()
        except BaseException:
            self._finished(connection)
            raise

    def _finished(self, connection: http.client.HTTPConnection | None) -> None:
        if connection is not None:
            with self._lock:
                self._open.discard(connection)
            connection.close()

    def _exchange(self, result: RequestResult, body: dict, read) -> None:
        """POST `body` to /v1/completions and hand the response to `read`; a transport failure is the result's
        error. The connection is released (or dropped) either way."""
        connection = None
        try:
            connection, response = self._post("/v1/completions", body)
            read(response)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._finished(connection)

    def close(self) -> None:
        pass

    def abort(self) -> None:
        """End every request still running, from another thread (see LockstepWebSocket.abort)."""
        with self._lock:
            connections = list(self._open)
        for connection in connections:
            _shut_down(connection.sock)


class LockstepRest(_HttpTarget):
    api = "lockstep-rest"

    def send(self, spec: RequestSpec, sampling: Sampling, on_first_text: OnFirstText = None) -> RequestResult:
        """Not streamed: `on_first_text` is never called (the text arrives with the end)."""
        result = RequestResult(spec.index, is_streaming=False)
        body = {"prompt": spec.prompt, "max_tokens": spec.output_len, **sampling.body_fields()}
        stopwatch = _Stopwatch(result)
        self._exchange(result, body, lambda response: _read_completion(result, response.status,
                                                                       json.loads(response.read())))
        stopwatch.stop()
        return result


def _read_completion(result: RequestResult, status: int, payload) -> None:
    if status != 200 or not isinstance(payload, dict) or not payload.get("choices"):
        result.error = f"HTTP {status}: {_error_text(payload)}"
        return
    choice = payload["choices"][0]
    result.success = True
    result.generated_text = choice.get("text") or ""
    result.finish_reason = choice.get("finish_reason")
    result.server_output_tokens = (payload.get("usage") or {}).get("completion_tokens")


class OpenAiCompletions(_HttpTarget):
    api = "openai"

    def __init__(self, base_url: str, model: str, timeout_s: float = 600.0, api_key: str = ""):
        super().__init__(base_url, timeout_s, api_key)
        self.model = model

    def send(self, spec: RequestSpec, sampling: Sampling, on_first_text: OnFirstText = None) -> RequestResult:
        result = RequestResult(spec.index)
        body = {"model": self.model, "prompt": spec.prompt, "max_tokens": spec.output_len, "stream": True,
                **sampling.body_fields()}
        if sampling.include_usage:
            body["stream_options"] = {"include_usage": True}
        stopwatch = _Stopwatch(result, on_first_text)
        self._exchange(result, body, lambda response: _read_stream_or_error(response, stopwatch))
        stopwatch.stop()
        return result


def _read_stream_or_error(response: http.client.HTTPResponse, stopwatch: _Stopwatch) -> None:
    if response.status != 200:
        stopwatch.result.error = f"HTTP {response.status}: {_error_text(_json_or_text(response.read()))}"
    else:
        _read_event_stream(response, stopwatch)


def _read_event_stream(response: http.client.HTTPResponse, stopwatch: _Stopwatch) -> None:
    """Pieces from the SSE chunks; success when the stream ends (at [DONE] or EOF) without an error chunk."""
    result = stopwatch.result
    chunks = iter(lambda: response.read1(READ_CHUNK_BYTES), b"")
    for data in iter_event_data(split_lines(chunks)):
        if data == DONE:
            break
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = f"stream error: {_error_text(chunk)}"
            return
        if choices := chunk.get("choices"):
            stopwatch.piece(choices[0].get("text") or "")
            result.finish_reason = choices[0].get("finish_reason") or result.finish_reason
        if usage := chunk.get("usage"):
            result.server_output_tokens = usage.get("completion_tokens")
    result.success = True


def _auth_headers(api_key: str) -> dict[str, str]:
    """lockstep (LOCKSTEP_API_KEY) and OpenAI servers both take a bearer token; lockstep's socket takes it on the
    handshake too."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _json_or_text(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def _error_text(payload) -> str:
    if isinstance(payload, dict) and isinstance(payload.get("error"), dict):
        return str(payload["error"].get("message"))[:300]
    return str(payload)[:300]

"""Shared load pieces for the fuzzer and the soak: raw HTTP and WebSocket calls that report what happened on
the wire, greedy references taken alone, the well-formed traffic that runs beside the fuzz or the soak and is
checked, a /health prober and a CPU burner.

Correctness of a greedy answer: every reference prompt is answered alone (one request at a time, before any load)
and the references must be pairwise distinct. An answer under load must equal its own prompt's reference; an
answer equal to *another* prompt's reference is a cross-delivery, anything else a mismatch. The servers we start
run in float32, where a request's greedy tokens do not depend on the batch it shares (bfloat16 can flip a
near-tie when the batch changes shape), so exact equality is the check.
"""
import http.client
import json
import logging
import multiprocessing
import os
import queue
import socket
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import websocket

logger = logging.getLogger(__name__)

GREEDY_TOKENS = 12
# Prompts whose greedy continuations differ from each other (checked when references are taken).
REFERENCE_PROMPTS = (
    "The capital of France is",
    "1, 2, 3, 4, 5,",
    "Roses are red, violets are",
    "def fibonacci(n):",
    "The opposite of hot is",
    "Water boils at a temperature of",
    "Once upon a time, in a small village,",
    "The three primary colors are",
)
CHAT_REFERENCE = [{"role": "user", "content": "Name three fruits."}]
# Responses conversations (REST and socket), a first turn and a follow-up that continues it.
RESPONSES_PATH = "/v1/responses"
RESPONSES_PROMPTS = REFERENCE_PROMPTS[:4]
FOLLOW_UP = "Now say it in French."  # its answers differ per prompt and from the first turns (checked)
RESPONSES_FINAL = ("response.completed", "response.incomplete", "response.failed")
ERROR_KEYS = {"message", "type", "param", "code"}
# The server admits fairly per client address: the checked traffic comes from a loopback address of its own, so
# it is a second client beside the fuzz (Linux routes all of 127/8 to lo), as a real user beside an abuser would be.
CHECKED_CLIENT_ADDRESS = "127.0.0.2"


# -- HTTP ---------------------------------------------------------------------------------------------------------

@dataclass
class HttpOutcome:
    status: int | None  # None: no HTTP response at all
    body: bytes = b""
    content_type: str = ""
    elapsed_s: float = 0.0
    failure: str | None = None  # "timeout", "reset", "refused", ... when status is None

    def json(self):
        try:
            return json.loads(self.body)
        except ValueError:
            return None


def http_call(host: str, port: int, method: str, path: str, body: bytes | None = None,
              headers: dict | None = None, timeout: float = 60.0, source: str | None = None) -> HttpOutcome:
    """One request on a fresh connection; never raises for network trouble (it is reported instead)."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection(host, port, timeout=timeout,
                                            source_address=(source, 0) if source else None)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
        return HttpOutcome(response.status, data, response.getheader("Content-Type", ""),
                           time.perf_counter() - started)
    except (TimeoutError, socket.timeout):
        return HttpOutcome(None, elapsed_s=time.perf_counter() - started, failure="timeout")
    except (OSError, http.client.HTTPException) as exc:
        return HttpOutcome(None, elapsed_s=time.perf_counter() - started, failure=_network_failure(exc))
    finally:
        connection.close()


def post_json(host: str, port: int, path: str, payload: dict, timeout: float = 120.0,
              source: str | None = CHECKED_CLIENT_ADDRESS) -> HttpOutcome:
    """A well-formed JSON POST, from the checked client's address unless told otherwise."""
    return http_call(host, port, "POST", path, json.dumps(payload).encode(), {"Content-Type": "application/json"},
                     timeout, source)


def _network_failure(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError)):
        return "reset"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "closed_without_response"
    return type(exc).__name__


def has_error_shape(payload) -> bool:
    """{"error": {"message", "type", "param", "code"}}, as the API contract says for every REST error."""
    return isinstance(payload, dict) and isinstance(payload.get("error"), dict) \
        and ERROR_KEYS <= set(payload["error"]) and isinstance(payload["error"].get("message"), str)


# -- WebSocket ----------------------------------------------------------------------------------------------------

@dataclass
class WsReadResult:
    messages: list = field(default_factory=list)  # parsed JSON text frames, in order
    arrivals: list = field(default_factory=list)  # perf_counter() when each message arrived
    close_code: int | None = None  # the code of the server's close frame
    ended: str | None = None  # "close", "eof" (no close frame), "reset", "timeout", "protocol", "non_json"


def ws_connect(url: str, timeout: float = 30.0, source: str | None = None) -> websocket.WebSocket:
    """A WebSocket (from the address `source` if given) that hands us invalid UTF-8 instead of refusing it."""
    options = {}
    if source:
        parts = urlsplit(url)
        options["socket"] = socket.create_connection((parts.hostname, parts.port), timeout, (source, 0))
    return websocket.create_connection(url, timeout=timeout, skip_utf8_validation=True, **options)


def ws_read_until(ws: websocket.WebSocket, is_last, timeout: float) -> WsReadResult:
    """Read frames until `is_last(message)` is true, the socket closes or `timeout` passes (each frame is parsed
    as JSON; a close frame's code is kept so that "closed without a code" can be told apart)."""
    result = WsReadResult()
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            result.ended = "timeout"
            return result
        ws.settimeout(remaining)
        frame_result = _next_frame(ws, result)
        if frame_result is not None:
            return frame_result
        if result.messages and is_last(result.messages[-1]):
            return result


def _next_frame(ws, result: WsReadResult) -> WsReadResult | None:
    """Read one frame into `result`; returns `result` when the socket has ended."""
    try:
        opcode, frame = ws.recv_data_frame(control_frame=False)
    except websocket.WebSocketTimeoutException:
        result.ended = "timeout"
        return result
    except websocket.WebSocketConnectionClosedException:
        result.ended = "eof"
        return result
    except websocket.WebSocketProtocolException:
        result.ended = "protocol"
        return result
    except (ConnectionResetError, BrokenPipeError):
        result.ended = "reset"
        return result
    except OSError as exc:
        result.ended = type(exc).__name__
        return result
    if opcode == websocket.ABNF.OPCODE_CLOSE:
        result.ended = "close"
        result.close_code = int.from_bytes(frame.data[:2], "big") if len(frame.data) >= 2 else None
        return result
    try:
        result.messages.append(json.loads(frame.data))
        result.arrivals.append(time.perf_counter())
    except ValueError:
        result.ended = "non_json"
        return result
    return None


def close_quietly(ws) -> None:
    try:
        ws.close(timeout=1)
    except Exception:  # noqa: BLE001 - the socket may already be gone; nothing to report
        pass


# -- greedy references ---------------------------------------------------------------------------------------------

@dataclass
class References:
    """Each prompt's greedy answer, taken alone before any load."""
    by_prompt: dict[str, str]
    chat: str
    exact: bool = True  # float32: any difference is a failure; bfloat16: a difference may be batch drift
    responses: dict[str, str] = field(default_factory=dict)  # prompt -> its first turn on /v1/responses
    follow_ups: dict[str, str] = field(default_factory=dict)  # prompt -> FOLLOW_UP's answer after that turn

    def verdict(self, prompt: str, text: str | None, table: dict | None = None) -> str:
        """ok, cross_delivered (another request's answer), mismatch, or drift (a mismatch on a bf16 server).
        `table` is the kind's own references (the short prompts' by default)."""
        if text == (self.by_prompt if table is None else table).get(prompt):
            return "ok"
        if text in self.every_answer():
            return "cross_delivered"
        return "mismatch" if self.exact else "drift"

    def every_answer(self) -> list[str]:
        return [*self.by_prompt.values(), self.chat, *self.responses.values(), *self.follow_ups.values()]


def greedy_params(tokens: int = GREEDY_TOKENS) -> dict:
    return {"max_tokens": tokens, "temperature": 0, "ignore_eos": True}


def server_dtype(host: str, port: int) -> str | None:
    outcome = http_call(host, port, "GET", "/v1/models", timeout=10)
    data = (outcome.json() or {}).get("data") or [{}]
    return data[0].get("dtype")


def take_references(host: str, port: int, prompts=REFERENCE_PROMPTS) -> References:
    answers = {}
    for prompt in prompts:
        outcome = post_json(host, port, "/basic_generate", {"prompt": prompt, **greedy_params()})
        if outcome.status != 200:
            raise RuntimeError(f"reference for {prompt!r} failed: {outcome.status} {outcome.body[:200]!r}")
        answers[prompt] = outcome.json()["generated_text"]
    if len(set(answers.values())) != len(answers):
        raise RuntimeError(f"reference answers are not distinct, a cross-delivery could pass unseen: {answers}")
    chat = post_json(host, port, "/v1/chat/completions", {"messages": CHAT_REFERENCE, **greedy_params()})
    if chat.status != 200:
        raise RuntimeError(f"chat reference failed: {chat.status} {chat.body[:200]!r}")
    return References(answers, chat.json()["choices"][0]["message"]["content"],
                      exact=server_dtype(host, port) == "float32")


def responses_greedy(tokens: int = GREEDY_TOKENS) -> dict:
    return {"max_output_tokens": tokens, "temperature": 0, "ignore_eos": True}


def response_text(response) -> str | None:
    """The text of a response object's message (what the SDK calls output_text)."""
    try:
        return "".join(part["text"] for item in response["output"] if item.get("type") == "message"
                       for part in item["content"] if part.get("type") == "output_text")
    except (KeyError, TypeError, AttributeError):
        return None


def take_responses_references(host: str, port: int, refs: References) -> None:
    """Each Responses prompt's first turn and its follow-up (previous_response_id, from the store), alone."""
    for prompt in RESPONSES_PROMPTS:
        first = _responses_alone(host, port, {"input": prompt})
        follow_up = _responses_alone(host, port, {"input": FOLLOW_UP, "previous_response_id": first["id"]})
        refs.responses[prompt], refs.follow_ups[prompt] = response_text(first), response_text(follow_up)
    answers = refs.every_answer()
    if len(set(answers)) != len(answers):
        raise RuntimeError(f"reference answers are not distinct, a cross-delivery could pass unseen: {answers}")


def _responses_alone(host: str, port: int, body: dict) -> dict:
    outcome = post_json(host, port, RESPONSES_PATH, {**body, **responses_greedy()})
    if outcome.status != 200:
        raise RuntimeError(f"Responses reference for {body!r} failed: {outcome.status} {outcome.body[:200]!r}")
    return outcome.json()


# -- checked traffic beside the fuzz / soak ----------------------------------------------------------------------

@dataclass
class CheckedTraffic:
    """What the well-formed clients saw: every failure is a finding (target: none)."""
    done: Counter = field(default_factory=Counter)  # requests completed correctly, by kind
    drift: Counter = field(default_factory=Counter)  # bf16 only: answers that differ from the alone reference
    failures: list = field(default_factory=list)  # (kind, detail)
    latencies_s: dict = field(default_factory=lambda: defaultdict(list))  # kind -> seconds
    max_inter_token_gap_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record_ok(self, kind: str, latency_s: float | None) -> None:
        with self.lock:
            self.done[kind] += 1
            if latency_s is not None:
                self.latencies_s[kind].append(latency_s)

    def record_answer(self, kind: str, verdict: str, latency_s: float, detail: str) -> None:
        if verdict == "ok":
            self.record_ok(kind, latency_s)
        elif verdict == "drift":
            with self.lock:
                self.drift[kind] += 1
                self.latencies_s[kind].append(latency_s)
        else:
            self.record_failure(kind, f"{verdict}: {detail}")

    def record_failure(self, kind: str, detail: str) -> None:
        logger.warning("well-formed %s failed: %s", kind, detail)
        with self.lock:
            self.failures.append((kind, detail[:500]))

    def record_gap(self, gap_s: float) -> None:
        with self.lock:
            self.max_inter_token_gap_s = max(self.max_inter_token_gap_s, gap_s)

    def failure_kinds(self) -> Counter:
        return Counter(f"{kind} {detail.split(':')[0]}" for kind, detail in self.failures)

    def latency_summary(self) -> dict:
        with self.lock:
            return {kind: {"n": len(values), "p50_ms": ms(percentile(values, 50)), "p99_ms": ms(percentile(values, 99))}
                    for kind, values in self.latencies_s.items()}


def check_rest_answer(traffic: CheckedTraffic, refs: References, kind: str, prompt: str,
                      outcome: HttpOutcome, text_of=lambda body: body.get("generated_text"),
                      table: dict | None = None) -> None:
    """A 200 whose text (`text_of` the body) is `prompt`'s reference in `table` (the short prompts' by default)."""
    if outcome.status != 200:
        traffic.record_failure(kind, f"status {outcome.status or outcome.failure}: {outcome.body[:200]!r}")
        return
    text = text_of(outcome.json() or {})
    traffic.record_answer(kind, refs.verdict(prompt, text, table), outcome.elapsed_s, f"{prompt!r} got {text!r}")


def responses_rest_conversation(host: str, port: int, prompt: str, refs: References,
                                traffic: CheckedTraffic) -> None:
    """Two turns over POST /v1/responses, the second continuing the stored first: each its own reference."""
    first = post_json(host, port, RESPONSES_PATH, {"input": prompt, **responses_greedy()}, timeout=300)
    check_rest_answer(traffic, refs, "responses", prompt, first, response_text, refs.responses)
    if first.status != 200:
        return
    follow_up = post_json(host, port, RESPONSES_PATH, {"input": FOLLOW_UP, "store": False, **responses_greedy(),
                                                       "previous_response_id": first.json()["id"]}, timeout=300)
    check_rest_answer(traffic, refs, "responses", prompt, follow_up, response_text, refs.follow_ups)


def stream_greedy(ws_url: str, prompts, refs: References, traffic: CheckedTraffic, tag: str,
                  timeout: float = 180.0) -> None:
    """Several greedy requests at once on one socket; each stream's text must be its own prompt's reference."""
    ws = ws_connect(ws_url, timeout=timeout, source=CHECKED_CLIENT_ADDRESS)
    try:
        ids = {f"{tag}-{i}": prompt for i, prompt in enumerate(prompts)}
        started = time.perf_counter()
        for request_id, prompt in ids.items():
            ws.send(json.dumps({"type": "generate", "id": request_id, "prompt": prompt, **greedy_params()}))
        _collect_streams(ws, ids, refs, traffic, started, timeout)
    finally:
        close_quietly(ws)


def _collect_streams(ws, ids: dict, refs: References, traffic: CheckedTraffic, started: float,
                     timeout: float) -> None:
    pending = set(ids)
    result = ws_read_until(ws, lambda m: _finished_one(m, pending), timeout)
    texts, finals = texts_and_finals(result, ids, traffic)
    for request_id, prompt in ids.items():
        final = finals.get(request_id)
        if final is None:
            traffic.record_failure("ws", f"lost: no done for {request_id} (socket {result.ended}, "
                                         f"close code {result.close_code})")
        elif final["type"] == "error":
            traffic.record_failure("ws", f"error: {final.get('code')} {final.get('message', '')[:200]}")
        else:
            traffic.record_answer("ws", refs.verdict(prompt, texts[request_id]), time.perf_counter() - started,
                                  f"{prompt!r} got {texts[request_id]!r}")


def texts_and_finals(result: WsReadResult, ids: dict, traffic: CheckedTraffic) -> tuple[dict, dict]:
    """Each stream's text, its final frame (the first: a cancel sent as the stream ended is answered
    `unknown_id` after it), and the gaps between its consecutive deltas (as they arrived)."""
    texts = {request_id: "" for request_id in ids}
    last_delta: dict[str, float] = {}
    finals = {}
    for message, arrived in zip(result.messages, result.arrivals):
        request_id = message.get("id")
        if message.get("type") == "delta" and request_id in texts:
            texts[request_id] += message.get("text", "")
            if request_id in last_delta:
                traffic.record_gap(arrived - last_delta[request_id])
            last_delta[request_id] = arrived
        elif message.get("type") in ("done", "error"):
            if request_id not in finals:
                finals[request_id] = message
            elif message.get("code") != "unknown_id":  # only a cancel that crossed the stream's done may follow it
                traffic.record_failure("ws", f"a second final frame for {request_id}: {message}")
    return texts, finals


def _finished_one(message: dict, pending: set) -> bool:
    if message.get("type") in ("done", "error"):
        pending.discard(message.get("id"))
    return not pending


def responses_ws_url(ws_url: str) -> str:
    return ws_url.removesuffix("/ws") + RESPONSES_PATH


def responses_socket_conversation(ws_url: str, prompts, refs: References, traffic: CheckedTraffic,
                                  timeout: float = 300.0) -> None:
    """One /v1/responses socket, one lane (stream_id) per prompt, all at once; each lane's follow-up continues
    its first turn by previous_response_id (the socket's own memory: store false). Every turn's streamed text
    must be its own reference."""
    ws = ws_connect(responses_ws_url(ws_url), timeout=timeout, source=CHECKED_CLIENT_ADDRESS)
    try:
        conversation = _SocketConversation(ws, dict(zip((f"lane{i}" for i in range(len(prompts))), prompts)), refs,
                                           traffic)
        result = ws_read_until(ws, conversation.on_event, timeout)
        for lane in conversation.pending:
            traffic.record_failure("responses_ws", f"lost: no final event on {lane} (socket {result.ended}, "
                                                   f"close code {result.close_code})")
    finally:
        close_quietly(ws)


class _SocketConversation:
    def __init__(self, ws, prompts: dict, refs: References, traffic: CheckedTraffic):
        self.ws, self.prompts, self.refs, self.traffic = ws, prompts, refs, traffic
        self.pending = set(prompts)
        self.texts = {lane: "" for lane in prompts}
        self.tables = {lane: refs.responses for lane in prompts}  # the turn each lane is on
        self.started = time.perf_counter()
        for lane, prompt in prompts.items():
            self._create(lane, {"input": prompt})

    def _create(self, lane: str, body: dict) -> None:
        self.ws.send(json.dumps({"type": "response.create", "stream_id": lane, "store": False, **body,
                                 **responses_greedy()}))

    def on_event(self, event: dict) -> bool:
        lane, kind = event.get("stream_id"), event.get("type")
        if lane not in self.pending:
            self.traffic.record_failure("responses_ws", f"an event for no lane of ours: {str(event)[:200]}")
        elif kind == "response.output_text.delta":
            self.texts[lane] += event.get("delta", "")
        elif kind == "error":
            self.traffic.record_failure("responses_ws", f"error {event.get('error')}"[:300])
            self.pending.discard(lane)
        elif kind in RESPONSES_FINAL:
            self._finish_turn(lane, event["response"])
        return not self.pending

    def _finish_turn(self, lane: str, response: dict) -> None:
        prompt, text = self.prompts[lane], self.texts[lane]
        self.traffic.record_answer("responses_ws", self.refs.verdict(prompt, text, self.tables[lane]),
                                   time.perf_counter() - self.started, f"{lane} {prompt!r} got {text!r}")
        if self.tables[lane] is self.refs.follow_ups:
            self.pending.discard(lane)
            return
        self.texts[lane], self.tables[lane] = "", self.refs.follow_ups
        self._create(lane, {"input": FOLLOW_UP, "previous_response_id": response.get("id")})


# -- background loops -----------------------------------------------------------------------------------------------

class Loop(threading.Thread):
    """A daemon thread that calls `body()` until `stop` is set, pausing `pause_s` between calls."""

    def __init__(self, name: str, body, stop: threading.Event, pause_s: float = 0.0):
        super().__init__(name=name, daemon=True)
        self.body, self.stop, self.pause_s = body, stop, pause_s
        self.crash: BaseException | None = None

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.body()
            except Exception as exc:  # noqa: BLE001 - a crashed checker must be reported, not silently gone
                logger.exception("%s crashed", self.name)
                self.crash = exc
                return
            self.stop.wait(self.pause_s)


class HealthProbe:
    """GET /health on a fresh connection every `interval_s`, as a load balancer would, from a process of its own:
    a thread here would also time this process's GIL, busy with the fuzz's megabyte bodies."""

    def __init__(self, host: str, port: int, stop: threading.Event, interval_s: float = 0.25):
        context = multiprocessing.get_context("spawn")
        self._stop_process = context.Event()
        self._results = context.Queue()
        self._process = context.Process(target=_probe_health, args=(host, port, interval_s, self._stop_process,
                                                                      self._results), daemon=True)
        self.latencies_s: list[float] = []
        self.failures = Counter()
        self.loop = _ProbeHandle(self, stop)

    def start(self) -> None:
        self._process.start()

    def finish(self, timeout: float) -> None:
        self._stop_process.set()
        try:
            self.latencies_s, failures = self._results.get(timeout=timeout)
            self.failures.update(failures)
        except queue.Empty:
            self.failures["prober_lost"] += 1
        self._process.join(5)

    def summary(self) -> dict:
        return {"probes": len(self.latencies_s), "failures": dict(self.failures),
                "p50_ms": ms(percentile(self.latencies_s, 50)), "p95_ms": ms(percentile(self.latencies_s, 95)),
                "p99_ms": ms(percentile(self.latencies_s, 99)), "max_ms": ms(max(self.latencies_s, default=0.0)),
                "over_100ms": sum(latency > 0.1 for latency in self.latencies_s)}


class _ProbeHandle:
    """Lets the prober stand in a list of Loops: start(), join() once `stop` is set, crash, name."""

    def __init__(self, probe: HealthProbe, stop: threading.Event):
        self.probe, self.stop, self.name, self.crash = probe, stop, "health-probe", None

    def start(self) -> None:
        self.probe.start()

    def join(self, timeout: float | None = None) -> None:
        self.stop.wait(timeout)
        self.probe.finish(timeout or 30)


def _probe_health(host: str, port: int, interval_s: float, stop, results) -> None:
    latencies, failures = [], Counter()
    while not stop.wait(interval_s):
        outcome = http_call(host, port, "GET", "/health", timeout=10)
        latencies.append(outcome.elapsed_s)
        if outcome.status != 200:
            failures[str(outcome.status or outcome.failure)] += 1
    results.put((latencies, dict(failures)))


def percentile(values, p: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[index]


def ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


# -- CPU burner ----------------------------------------------------------------------------------------------------

def _burn(stop) -> None:
    while not stop.is_set():
        sum(i * i for i in range(10000))


class CpuBurner:
    """One spinning process per core (spawned, so nothing of this process is inherited)."""

    def __init__(self, processes: int | None = None):
        context = multiprocessing.get_context("spawn")
        self.stop = context.Event()
        self.processes = [context.Process(target=_burn, args=(self.stop,), daemon=True)
                          for _ in range(processes or os.cpu_count() or 1)]

    def __enter__(self) -> "CpuBurner":
        for process in self.processes:
            process.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()

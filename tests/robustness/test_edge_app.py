"""Issue 9 against a live werkzeug server: keys, origins and Host, socket budget and timers, close codes, protocol
errors, a vanished REST client, readiness and the drain. Real sockets; fault injection only where named."""
import functools
import json
import logging
import socket
import threading
import time

import pytest
import websocket

from app.settings import ServerSettings
from engine import EngineConfig

from ..client import WsClient, http, wait_until
from ..conftest import LiveServer, start_live_server

KEY = "sekret-4f1c"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    live = start_live_server(tiny_model_dir, ServerSettings(max_body_bytes=16384))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def keyed(tiny_model_dir):
    live = start_live_server(tiny_model_dir, ServerSettings(api_key=KEY, ws_auth_timeout_s=1.0))
    yield live
    live.stop()


def close_frame(ws: WsClient) -> tuple[int, str]:
    """Read until the server's close frame: (code, reason). A reset instead fails the test."""
    while True:
        opcode, data = ws.ws.recv_data(control_frame=True)
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            return int.from_bytes(data[:2], "big"), data[2:].decode()


def raw_request(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send raw bytes, read the whole answer (the server closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(data)
        chunks = []
        while chunk := conn.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def status_and_json(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


def port_of(live) -> int:
    return live.server.server_port


# ---- 4. API key ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("header, status", [
    (f"Bearer {KEY}", 200),
    (f"bearer {KEY}", 200),
    (f"BEARER {KEY}", 200),
    (KEY, 401),  # a bare key without the scheme
    (f"Bearer {KEY} extra", 401),
    (f"Basic {KEY}", 401),
    ("Bearer", 401),
    (f"Bearer {KEY}x", 401),
    (f"Bearer {KEY[:-1]}", 401),
])
def test_rest_takes_only_a_bearer_header(keyed, header, status):
    got, _, body = http("POST", keyed.url + "/tokenize", {"prompt": "x"}, headers={"Authorization": header})
    assert got == status, body
    if status == 401:
        assert body["error"]["code"] == "invalid_api_key"


def test_the_key_in_the_url_is_refused_everywhere(keyed):
    assert http("POST", keyed.url + f"/tokenize?api_key={KEY}", {"prompt": "x"})[0] == 401
    ws = WsClient(keyed.ws_url + f"?api_key={KEY}")  # the socket opens, but the URL did not authenticate it
    ws.generate("a", prompt="Hi", max_tokens=2)
    assert ws.recv()["code"] == "auth_required"
    assert close_frame(ws)[0] == 1008


def test_an_unauthenticated_frame_is_refused_for_its_missing_key_before_its_text(keyed):
    ws = WsClient(keyed.ws_url)
    ws.send('{"type": "generate", "id": "a", "prompt": "\\ud800"}')
    assert ws.recv()["code"] == "auth_required"
    assert close_frame(ws)[0] == 1008


def test_socket_authenticates_with_its_first_frame(keyed):
    ws = WsClient(keyed.ws_url)
    ws.send({"type": "auth", "api_key": KEY})
    assert ws.recv() == {"type": "ready"}
    ws.generate("a", prompt="Hi", max_tokens=2, ignore_eos=True)
    assert ws.collect(["a"])["a"]["final"]["type"] == "done"
    ws.close()


def test_socket_with_a_wrong_key_is_closed_with_1008(keyed):
    ws = WsClient(keyed.ws_url)
    ws.send({"type": "auth", "api_key": KEY + "x"})
    assert ws.recv()["code"] == "invalid_api_key"
    assert close_frame(ws)[0] == 1008


def test_socket_that_never_authenticates_is_closed_with_1008(keyed):
    ws = WsClient(keyed.ws_url)
    started = time.monotonic()
    assert close_frame(ws) == (1008, "authentication timeout")
    assert time.monotonic() - started < 5


def test_socket_may_authenticate_on_its_handshake(keyed):
    ws = WsClient(keyed.ws_url, header=[f"Authorization: Bearer {KEY}"])
    ws.generate("a", prompt="Hi", max_tokens=2, ignore_eos=True)
    assert ws.collect(["a"])["a"]["final"]["type"] == "done"
    ws.close()
    with pytest.raises(websocket.WebSocketBadStatusException) as info:
        websocket.create_connection(keyed.ws_url, header=[f"Authorization: Bearer {KEY}x"], timeout=10)
    assert info.value.status_code == 401


# ---- 5. Origins and Host --------------------------------------------------------------------------------------

def test_socket_origins_are_checked_against_the_bind_address(server):
    port = port_of(server)
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
        websocket.create_connection(server.ws_url, origin=origin, timeout=10).close()
    for origin in (f"https://127.0.0.1:{port}", f"http://127.0.0.1:{port + 1}", "http://evil.example",
                   f"http://evil.example:{port}", "null"):
        with pytest.raises(websocket.WebSocketBadStatusException) as info:
            websocket.create_connection(server.ws_url, origin=origin, timeout=10)
        assert info.value.status_code == 403, origin


def test_dns_rebinding_host_is_refused(server):
    port = port_of(server)
    with pytest.raises(websocket.WebSocketBadStatusException) as info:
        websocket.create_connection(server.ws_url, host=f"evil.example:{port}", origin=f"http://evil.example:{port}",
                                    timeout=10)
    assert info.value.status_code == 421
    status, _, body = http("GET", server.url + "/v1/models", headers={"Host": f"evil.example:{port}"})
    assert status == 421 and body["error"]["code"] == "misdirected_request"
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"):
        assert http("GET", server.url + "/v1/models", headers={"Host": host})[0] == 200, host


def test_cors_allows_only_public_origins(server):
    port = port_of(server)
    _, headers, _ = http("GET", server.url + "/v1/models", headers={"Origin": f"http://localhost:{port}"})
    assert headers["Access-Control-Allow-Origin"] == f"http://localhost:{port}"
    _, headers, _ = http("GET", server.url + "/v1/models", headers={"Origin": f"http://evil.example:{port}",
                                                                    "Host": f"127.0.0.1:{port}"})
    assert "Access-Control-Allow-Origin" not in headers


def test_a_preflight_allows_every_method_a_browser_may_send(server):
    origin = f"http://localhost:{port_of(server)}"
    _, headers, _ = http("OPTIONS", server.url + "/v1/responses/resp_x",
                         headers={"Origin": origin, "Access-Control-Request-Method": "DELETE"})
    assert headers["Access-Control-Allow-Origin"] == origin
    assert {m.strip() for m in headers["Access-Control-Allow-Methods"].split(",")} == {"GET", "POST", "DELETE",
                                                                                       "OPTIONS"}


# ---- 1. Socket budget and timers ----------------------------------------------------------------------------

def test_sockets_over_the_cap_are_refused_before_the_upgrade(make_server_for, tiny_model_dir):
    live = make_server_for(tiny_model_dir, ServerSettings(max_sockets=2))
    first, second = WsClient(live.ws_url), WsClient(live.ws_url)
    with pytest.raises(websocket.WebSocketBadStatusException) as info:
        websocket.create_connection(live.ws_url, timeout=10)
    assert info.value.status_code == 503 and info.value.resp_headers["retry-after"]
    assert json.loads(info.value.resp_body)["error"]["code"] == "too_many_sockets"
    first.close()
    wait_until(lambda: live.state.sockets.num_open == 1)
    third = WsClient(live.ws_url)
    third.generate("a", prompt="Hi", max_tokens=2)
    assert third.collect(["a"])["a"]["final"]["type"] == "done"
    second.close()
    third.close()


def test_idle_socket_is_closed_but_a_busy_one_is_not(make_server_for, tiny_model_dir):
    live = make_server_for(tiny_model_dir, ServerSettings(ws_idle_timeout_s=1.5))
    idle, busy = WsClient(live.ws_url), WsClient(live.ws_url)
    busy.generate("long", prompt="Hello", max_tokens=200, ignore_eos=True)
    assert close_frame(idle) == (1001, "idle timeout")
    final = busy.collect(["long"])["long"]["final"]
    assert final["type"] == "done" and final["finish_reason"] == "length"


# ---- 6. Close codes and protocol errors ------------------------------------------------------------------------

@pytest.mark.parametrize("size", [300 << 10, 1 << 20])
def test_oversize_frames_get_close_1009_never_a_reset(server, size):
    for _ in range(5):
        ws = WsClient(server.ws_url)
        ws.send({"type": "generate", "id": "big", "prompt": "x" * size})
        assert close_frame(ws)[0] == 1009
    assert http("GET", server.url + "/health")[0] == 200


def test_upgrade_without_key_or_version_is_a_json_400(server):
    port = port_of(server)
    upgrade = f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    status, body = status_and_json(raw_request(port, (upgrade + "Sec-WebSocket-Version: 13\r\n\r\n").encode()))
    assert status == 400 and body["error"]["code"] == "invalid_handshake"
    status, body = status_and_json(raw_request(port, (upgrade + "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
                                               .encode()))
    assert status == 426 and body["error"]["code"] == "invalid_handshake"
    status, body = status_and_json(raw_request(port, f"GET /ws HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()))
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}


def chunked_post(port: int, chunks: bytes) -> bytes:
    head = (f"POST /basic_generate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode()
    return raw_request(port, head + chunks)


def test_bad_chunk_size_is_a_400(server):
    status, body = status_and_json(chunked_post(port_of(server), b"zz\r\n{}\r\n0\r\n\r\n"))
    assert status == 400 and body["error"]["code"] == "invalid_body"


def test_chunked_body_over_the_limit_is_a_413_not_cut(server):
    payload = json.dumps({"prompt": "x" * 20000}).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(payload[i:i + 4096]), payload[i:i + 4096])
                      for i in range(0, len(payload), 4096)) + b"0\r\n\r\n"
    status, body = status_and_json(chunked_post(port_of(server), chunks))
    assert status == 413 and body["error"]["code"] == "request_entity_too_large"


@pytest.mark.parametrize("bad", [b"0", b"-1", b'"5"', b"true", b"1e400", b"Infinity", b"NaN", b"[]"])
def test_timeout_field_must_be_a_positive_finite_number(server, bad):
    status, _, body = http("POST", server.url + "/basic_generate", b'{"prompt": "x", "timeout": ' + bad + b"}")
    assert (status, body["error"]["param"], body["error"]["code"]) == (400, "timeout", "invalid_value")


def test_a_short_timeout_is_a_504(server, client):
    status, _, body = http("POST", server.url + "/basic_generate",
                           {"prompt": "Hello", "max_tokens": 250, "ignore_eos": True, "timeout": 0.05})
    assert status == 504 and body["error"]["code"] == "deadline_exceeded"
    client.generate("t", prompt="Hello", max_tokens=250, ignore_eos=True, timeout=0.05)
    final = client.collect(["t"])["t"]["final"]
    assert final["type"] == "error" and final["code"] == "deadline_exceeded"


# ---- 7. Exceptions never escape a socket session ----------------------------------------------------------------

def test_a_bug_while_starting_a_request_is_an_error_frame(server, client, monkeypatch):
    engine = server.state.engine

    def broken_submit(*args, **kwargs):  # fault injection: any bug below the socket (a chat template that raises)
        raise RuntimeError("template exploded")

    monkeypatch.setattr(engine, "submit", broken_submit)
    client.generate("t", messages=[{"role": "user", "content": "Hi"}])
    error = client.recv()
    assert error == {"type": "error", "id": "t", "code": "internal_error", "message": "internal server error",
                     "param": None}
    monkeypatch.undo()
    client.generate("after", prompt="Hi", max_tokens=2, ignore_eos=True)
    assert client.collect(["after"])["after"]["final"]["type"] == "done"


def test_broken_pipe_on_send_ends_the_session_and_cancels(server, monkeypatch, caplog):
    from simple_websocket import Server  # the socket flask-sock gives the route

    scheduler = server.state.engine.scheduler
    real_send, sent = Server.send, []

    def send_then_break(self, data):  # fault injection: the third frame hits a broken pipe
        sent.append(data)
        if len(sent) >= 3:
            raise BrokenPipeError(32, "Broken pipe")
        return real_send(self, data)

    monkeypatch.setattr(Server, "send", send_then_break)
    ws = WsClient(server.ws_url)
    ws.generate("a", prompt="Hello", max_tokens=250, ignore_eos=True)
    wait_until(lambda: len(sent) >= 3)
    wait_until(lambda: scheduler.num_running == 0 and scheduler.num_waiting == 0)
    monkeypatch.undo()
    assert http("GET", server.url + "/health")[0] == 200
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


# ---- 2. A REST client that hangs up -------------------------------------------------------------------------

def test_dropped_generate_frees_the_engine_and_logs_what_it_produced(make_server_for, tiny_model_dir, caplog):
    caplog.set_level(logging.INFO, logger="app.guards")
    live = make_server_for(tiny_model_dir, max_batch_size=4)
    scheduler = live.state.engine.scheduler
    body = json.dumps({"prompts": [f"Prompt {i}" for i in range(16)], "max_tokens": 250, "ignore_eos": True})
    conn = socket.create_connection(("127.0.0.1", port_of(live)), timeout=10)
    conn.sendall((f"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    wait_until(lambda: scheduler.num_running > 0)
    conn.close()
    started = time.monotonic()
    wait_until(lambda: scheduler.num_running == 0 and scheduler.num_waiting == 0, timeout=5)
    assert time.monotonic() - started < 2
    wait_until(lambda: any("status=499" in r.getMessage() for r in caplog.records))
    access = next(r.getMessage() for r in caplog.records if "status=499" in r.getMessage())
    assert "POST /generate" in access and int(access.split("tokens=")[1].split()[0]) > 0, access


# ---- 3. Readiness and the drain ----------------------------------------------------------------------------------

def test_drain_refuses_new_work_with_503_and_ready_says_so(make_server_for, tiny_model_dir):
    live = make_server_for(tiny_model_dir)
    ws = WsClient(live.ws_url)
    ws.generate("long", prompt="Hello", max_tokens=120, ignore_eos=True)
    assert ws.recv()["type"] == "start"
    live.state.begin_drain()
    status, headers, body = http("POST", live.url + "/basic_generate", {"prompt": "x", "max_tokens": 2})
    assert (status, body["error"]["code"]) == (503, "shutting_down") and headers["Retry-After"]
    status, _, body = http("GET", live.url + "/ready")
    assert status == 503 and "draining" in body["reason"]
    assert http("GET", live.url + "/health")[0] == 200
    with pytest.raises(websocket.WebSocketBadStatusException) as info:
        websocket.create_connection(live.ws_url, timeout=10)
    assert info.value.status_code == 503
    final = ws.collect(["long"])["long"]["final"]
    assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 120
    assert close_frame(ws) == (1001, "server shutting down")


def test_ready_stays_200_while_the_worker_is_busy_in_a_long_step(tiny_model_dir, monkeypatch, tmp_path):
    from app import create_app
    from engine import EngineConfig

    from ..worker_faults import FileGate, patch_worker, slow_handle_task

    slow_steps = FileGate(str(tmp_path / "slow-steps"))  # fault injection: a step lasts while the test holds it
    patch_worker(monkeypatch, handle_task=functools.partial(slow_handle_task, slow_steps.path))
    live = LiveServer(create_app({"ENGINE": EngineConfig(model=tiny_model_dir, dtype="float32", threads=1),
                                  "WAIT_FOR_MODEL": True}))
    try:
        slow_steps.hold()
        outcome = {}
        caller = threading.Thread(target=lambda: outcome.update(answer=http(
            "POST", live.url + "/basic_generate", {"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})))
        caller.start()
        wait_until(lambda: live.state.engine.num_running == 1)
        time.sleep(5.5)  # the step is now older than 5 s
        started = time.monotonic()
        status, _, body = http("GET", live.url + "/ready", timeout=10)
        assert (status, body["status"]) == (200, "ready") and time.monotonic() - started < 1.0
        slow_steps.release()
        caller.join(60)
        assert outcome["answer"][0] == 200
    finally:
        slow_steps.release()
        live.stop()


@pytest.mark.parametrize("variable, value, says", [
    ("LOCKSTEP_WS_PING_INTERVAL_S", "nan", r"ws_ping_interval_s \(LOCKSTEP_WS_PING_INTERVAL_S\) must be a number of "
                                           "seconds > 0 and at most 604800"),
    ("LOCKSTEP_WS_PING_INTERVAL_S", "3e6", "LOCKSTEP_WS_PING_INTERVAL_S.*at most 604800"),  # a socket's poll: 24.8 d
    ("LOCKSTEP_WS_IDLE_TIMEOUT_S", "0", "LOCKSTEP_WS_IDLE_TIMEOUT_S.* must be a number of seconds > 0"),
    ("LOCKSTEP_HEADER_TIMEOUT_S", "inf", "LOCKSTEP_HEADER_TIMEOUT_S.* must be a number of seconds > 0"),
    ("LOCKSTEP_HEADER_TIMEOUT_S", "1e10", "LOCKSTEP_HEADER_TIMEOUT_S.*at most 604800"),  # settimeout's time_t
    ("LOCKSTEP_DRAIN_TIMEOUT_S", "-1", "LOCKSTEP_DRAIN_TIMEOUT_S.* must be a number of seconds >= 0"),
    ("LOCKSTEP_DRAIN_TIMEOUT_S", "1e300", "LOCKSTEP_DRAIN_TIMEOUT_S.*at most 604800"),
    ("LOCKSTEP_MAX_SOCKETS", "0", r"max_sockets \(LOCKSTEP_MAX_SOCKETS\) must be at least 1"),
    ("LOCKSTEP_WS_MAX_MESSAGE_BYTES", "-5", "LOCKSTEP_WS_MAX_MESSAGE_BYTES.* must be at least 1"),
    ("LOCKSTEP_PORT", "70000", r"LOCKSTEP_PORT\) must be 1..65535"),
    ("LOCKSTEP_PORT", "0", r"LOCKSTEP_PORT\) must be 1..65535"),  # a random port the allowed origins cannot name
    ("LOCKSTEP_MAX_PROMPTS", "many", "LOCKSTEP_MAX_PROMPTS must be a number, got 'many'"),
    ("LOCKSTEP_LOG_LEVEL", "garbage", "LOCKSTEP_LOG_LEVEL.* must be one of debug, info"),
    ("LOCKSTEP_API_KEY", "", "LOCKSTEP_API_KEY.* is set but empty"),  # `$UNSET_VAR`: not a server without a key
    ("LOCKSTEP_API_KEY", "two words", "LOCKSTEP_API_KEY.* must not contain whitespace"),
])
def test_a_setting_out_of_range_is_refused_by_name(variable, value, says):
    with pytest.raises(ValueError, match=says):
        ServerSettings.from_env({variable: value})


@pytest.mark.parametrize("variable, value, says", [
    ("LOCKSTEP_STEP_TIMEOUT_S", "1e10", "LOCKSTEP_STEP_TIMEOUT_S.*at most 604800"),  # every step's wait overflowed
    ("LOCKSTEP_REQUEST_TIMEOUT_S", "nan", "LOCKSTEP_REQUEST_TIMEOUT_S.* must be a number of seconds > 0"),
    ("LOCKSTEP_THREADS", "99999999999999999999", r"LOCKSTEP_THREADS\) must be 0 \(all cores but one\) to 1024"),
    ("LOCKSTEP_THREADS", "-1", "LOCKSTEP_THREADS.* must be 0"),
    ("LOCKSTEP_GPU_MEMORY_UTILIZATION", "nan", r"LOCKSTEP_GPU_MEMORY_UTILIZATION\) must be a fraction in \(0, 1\]"),
    ("LOCKSTEP_GPU_MEMORY_UTILIZATION", "-5", "LOCKSTEP_GPU_MEMORY_UTILIZATION.* must be a fraction"),
    ("LOCKSTEP_MAX_MODEL_LEN", "-1", r"max_model_len \(LOCKSTEP_MAX_MODEL_LEN\) must be at least 0, got -1"),
    ("LOCKSTEP_MAX_BATCH_SIZE", "0", "LOCKSTEP_MAX_BATCH_SIZE.* must be at least 1"),
    ("LOCKSTEP_DTYPE", "int8", r"dtype \(LOCKSTEP_DTYPE\) must be one of"),
])
def test_an_engine_setting_out_of_range_is_refused_by_name(variable, value, says):
    with pytest.raises(ValueError, match=says):
        EngineConfig.from_env({variable: value})


def test_settings_in_range_are_taken_and_empty_means_the_default():
    settings = ServerSettings.from_env({"LOCKSTEP_DRAIN_TIMEOUT_S": "0", "LOCKSTEP_WS_PING_INTERVAL_S": "2.5",
                                        "LOCKSTEP_MAX_SOCKETS": "", "LOCKSTEP_ALLOWED_ORIGINS": "http://a.test/, b"})
    assert (settings.drain_timeout_s, settings.ws_ping_interval_s) == (0.0, 2.5)
    assert settings.max_sockets == ServerSettings().max_sockets
    assert settings.allowed_origins == ("http://a.test", "b")

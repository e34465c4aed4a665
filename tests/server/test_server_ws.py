"""WebSocket /ws against a live server with a real client: streaming, multiplexing, cancel, errors, disconnect."""

import socket

import pytest
import websocket

from ..client import WsClient, http, wait_until
from ..conftest import start_live_server


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    live = start_live_server(tiny_model_dir)
    yield live
    live.stop()


def test_stream_start_deltas_done(server, client):
    client.generate("a", prompt="Hello", max_tokens=12, ignore_eos=True)
    result = client.collect(["a"])["a"]
    types = [e["type"] for e in result["events"]]
    assert types[0] == "start" and types[-1] == "done" and types.count("delta") >= 2
    done = result["final"]
    assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 12
    assert done["timing"]["ttft_ms"] > 0 and done["timing"]["tokens_per_s"] > 0
    rest = http("POST", server.url + "/basic_generate", {"prompt": "Hello", "max_tokens": 12, "ignore_eos": True})
    assert result["text"] == rest[2]["generated_text"]


def test_two_requests_multiplexed_on_one_socket(client):
    client.generate("one", prompt="Hello", max_tokens=10, ignore_eos=True)
    client.generate("two", messages=[{"role": "user", "content": "Hi there"}], max_tokens=14, ignore_eos=True)
    results = client.collect(["one", "two"])
    assert results["one"]["final"]["usage"]["completion_tokens"] == 10
    assert results["two"]["final"]["usage"]["completion_tokens"] == 14
    deltas = [m["id"] for m in client.received if m["type"] == "delta"]
    assert deltas.index("two") < len(deltas) - 1 - deltas[::-1].index("one")  # interleaved, not one after the other


def test_cancel_gives_done_with_abort(client):
    client.generate("long", prompt="Hello", max_tokens=200, ignore_eos=True)
    assert client.recv()["type"] == "start"
    assert client.recv()["type"] == "delta"
    client.send({"type": "cancel", "id": "long"})
    final = client.collect(["long"])["long"]["final"]
    assert final["type"] == "done" and final["finish_reason"] == "abort"
    assert final["usage"]["completion_tokens"] < 200


@pytest.mark.parametrize("frame, code", [
    ("not json", "invalid_json"),
    ('{"type": "dance", "id": "x"}', "invalid_value"),
    ('{"type": "generate", "id": "x"}', "missing_field"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "temperature": -1}', "invalid_value"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "max_tokens": 0}', "invalid_value"),
    ('{"type": "generate", "prompt": "hi"}', "missing_field"),
    ('{"type": "generate", "id": 7, "prompt": "hi"}', "invalid_value"),
    ('{"type": "cancel", "id": "nobody"}', "unknown_id"),
    ("[" * 3000 + "]" * 3000, "invalid_json"),
    ('{"type": "generate", "id": "x", "prompt": "hi", "top_p": ' + "9" * 400 + "}", "invalid_value"),
    ('{"type": "generate", "id": "x", "prompt": "' + "word " * 300 + '"}', "context_length_exceeded"),
])
def test_bad_messages_get_an_error_and_the_socket_stays_usable(client, frame, code):
    client.send(frame)
    error = client.recv()
    assert error["type"] == "error" and error["code"] == code and error["message"]
    client.generate("after", prompt="Hi", max_tokens=3, ignore_eos=True)
    assert client.collect(["after"])["after"]["final"]["type"] == "done"


def close_code(ws: WsClient) -> int:
    """Read until the server's close frame; its status code."""
    while True:
        opcode, data = ws.ws.recv_data(control_frame=True)
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            return int.from_bytes(data[:2], "big")


def test_binary_frame_is_closed_with_1003(server):
    ws = WsClient(server.ws_url)
    ws.ws.send_binary(b'{"type": "generate", "id": "u", "prompt": "hi"}')
    assert close_code(ws) == 1003  # unsupported data


def test_invalid_utf8_text_frame_is_closed_with_1007(server):
    ws = WsClient(server.ws_url)
    ws.ws.send(b'{"type": "generate", "id": "u", "prompt": "\xff\xfe"}', opcode=websocket.ABNF.OPCODE_TEXT)
    assert close_code(ws) == 1007  # invalid frame payload data
    assert http("GET", server.url + "/health")[0] == 200


def test_duplicate_id_is_refused_while_running(client):
    client.generate("dup", prompt="Hello", max_tokens=40, ignore_eos=True)
    client.generate("dup", prompt="Hello", max_tokens=4)
    events = client.collect(["dup"], until=("done",))["dup"]["events"]
    assert any(e["type"] == "error" and e["code"] == "duplicate_id" for e in events)


def test_overloaded_is_an_error_on_the_socket(server, client):
    scheduler = server.state.engine.scheduler
    limit, scheduler.max_queue = scheduler.max_queue, 0
    try:
        client.generate("busy", prompt="Hi", max_tokens=3)
        error = client.recv()
    finally:
        scheduler.max_queue = limit
    assert error == {"type": "error", "id": "busy", "code": "overloaded", "message": error["message"],
                     "param": None}


def test_closing_the_socket_cancels_its_requests(server):
    scheduler = server.state.engine.scheduler
    ws = WsClient(server.ws_url)
    ws.generate("a", prompt="Hello", max_tokens=250, ignore_eos=True)
    ws.generate("b", prompt="World", max_tokens=250, ignore_eos=True)
    seen = 0
    while seen < 4:
        seen += ws.recv()["type"] == "delta"
    assert scheduler.num_running == 2
    ws.close()
    wait_until(lambda: scheduler.num_running == 0)
    _, _, metrics = http("GET", server.url + "/metrics")
    assert "lockstep:num_requests_running 0.0" in metrics
    assert 'lockstep:request_success_total{finished_reason="abort"}' in metrics


def no_sockets_open(server) -> None:
    """Wait until earlier tests' sockets have closed on the server, so that counts start from zero."""
    wait_until(lambda: server.state.sockets.num_open == 0, timeout=30, what="earlier tests' sockets closed")


def test_oversized_frame_closes_the_socket(server):
    no_sockets_open(server)
    ws = WsClient(server.ws_url)
    ws.send({"type": "generate", "id": "big", "prompt": "x" * (300 << 10)})
    opcode, data = ws.ws.recv_data(control_frame=True)
    assert opcode == websocket.ABNF.OPCODE_CLOSE and int.from_bytes(data[:2], "big") == 1009  # message too big
    assert http("GET", server.url + "/health")[0] == 200
    # its session ends and gives its slot back while the client keeps the connection (a leak let such clients
    # use up LOCKSTEP_MAX_SOCKETS)
    wait_until(lambda: server.state.sockets.num_open == 0, timeout=30, what="the socket's slot released")


def test_cross_site_socket_is_refused(server):
    with pytest.raises(websocket.WebSocketBadStatusException) as info:
        websocket.create_connection(server.ws_url, origin="http://evil.test", timeout=10)
    assert info.value.status_code == 403


def test_worker_failure_is_an_error_frame_and_the_next_request_works(server, client):
    import os
    import signal

    client.generate("doomed", prompt="Hello", max_tokens=250, ignore_eos=True)
    assert client.recv()["type"] == "start"
    assert client.recv()["type"] == "delta"
    os.kill(server.state.engine.executor.pid, signal.SIGKILL)
    final = client.collect(["doomed"])["doomed"]["final"]
    assert final["type"] == "error" and final["code"] == "worker_failed" and "died" in final["message"]
    client.generate("after", prompt="Hi", max_tokens=3, ignore_eos=True)
    assert client.collect(["after"])["after"]["final"]["finish_reason"] == "length"


def test_a_client_that_stops_reading_is_cut_off(server, monkeypatch):
    """Its frames would otherwise hold the session's thread in a send for good (and pile up in memory); small
    buffers on both ends so that a tiny model's answer fills them."""
    from app.sockets import transport as socket_transport

    monkeypatch.setattr(socket_transport, "SEND_TIMEOUT_S", 1.0)
    guarded = socket_transport.GuardedSocket.__init__

    def small_send_buffer(self, sock):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        guarded(self, sock)

    monkeypatch.setattr(socket_transport.GuardedSocket, "__init__", small_send_buffer)
    sockets = server.state.sockets
    no_sockets_open(server)  # an earlier socket's close would hide this one's open
    before = sockets.num_open
    client = WsClient(server.ws_url, sockopt=((socket.SOL_SOCKET, socket.SO_RCVBUF, 4096),))
    wait_until(lambda: sockets.num_open == before + 1, what="the socket open")
    for i in range(4):  # reads nothing from here on
        client.generate(f"big{i}", prompt="Hello", max_tokens=240, ignore_eos=True, logprobs=True, top_logprobs=20)
    wait_until(lambda: sockets.num_open == before, timeout=60, what="the silent client cut off")
    frames = []
    try:
        while True:
            frames.append(client.recv())
    except (websocket.WebSocketException, OSError):
        pass
    assert sum(frame["type"] == "done" for frame in frames) < 4  # cut off before its answers were out

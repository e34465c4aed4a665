"""app/ops/gunicorn_worker.py's LingeringCloser on its own: FIN at once, the close when the client closes, when the
linger is over, or at once past the cap (the served path is in tests/robustness/test_edge_gunicorn.py)."""
import socket
import time

import pytest

from app.ops import gunicorn_worker
from app.ops.gunicorn_worker import LingeringCloser, lingering_room


def wait_closed(sock: socket.socket, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while sock.fileno() != -1 and time.monotonic() < deadline:
        time.sleep(0.01)
    return sock.fileno() == -1


@pytest.fixture
def closer():
    closer = LingeringCloser()
    yield closer
    closer.stop(timeout=30)


@pytest.fixture
def pair():
    server_end, client_end = socket.socketpair()
    yield server_end, client_end
    client_end.close()


def test_the_client_reads_the_fin_at_once_and_its_close_ends_the_linger(closer, pair):
    server_end, client_end = pair
    closer.close(server_end)
    client_end.settimeout(10)
    assert client_end.recv(1) == b""  # FIN: the reply is complete
    assert server_end.fileno() != -1  # still reading what the client may send
    client_end.sendall(b"late bytes are read, never answered with a reset")
    client_end.close()
    assert wait_closed(server_end)


def test_a_client_that_never_closes_is_let_go_after_the_linger(closer, pair, monkeypatch):
    monkeypatch.setattr(gunicorn_worker, "LINGER_S", 0.2)
    server_end, client_end = pair
    closer.close(server_end)
    assert wait_closed(server_end)
    client_end.settimeout(10)
    assert client_end.recv(1) == b""


def test_past_the_cap_a_connection_is_closed_at_once(monkeypatch):
    monkeypatch.setattr(gunicorn_worker, "LINGER_S", 600)
    closer = LingeringCloser(max_lingering=1)
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        for server_end, _ in pairs:
            closer.close(server_end)
        assert wait_closed(pairs[1][0]) and wait_closed(pairs[2][0])
        assert pairs[0][0].fileno() != -1  # the first one lingers
        pairs[0][1].close()
        assert wait_closed(pairs[0][0])
    finally:
        closer.stop(timeout=30)
        for _, client_end in pairs:
            client_end.close()


def test_a_stopped_closer_closes_at_once(pair):
    closer = LingeringCloser()
    closer.stop(timeout=30)
    server_end, client_end = pair
    closer.close(server_end)
    assert server_end.fileno() == -1


def test_the_room_to_linger_leaves_gunicorns_connections_their_descriptors(monkeypatch):
    monkeypatch.setattr(gunicorn_worker.resource, "getrlimit", lambda _: (1024, 4096))
    assert lingering_room(1000) == 0  # systemd's default soft limit beside gunicorn's default: close at once
    assert lingering_room(100) == 1024 - 100 - gunicorn_worker.FD_RESERVE
    monkeypatch.setattr(gunicorn_worker.resource, "getrlimit", lambda _: (1 << 20, 1 << 20))
    assert lingering_room(1000) == gunicorn_worker.MAX_LINGERING

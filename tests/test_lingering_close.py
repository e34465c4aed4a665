"""app/gunicorn_worker.py's LingeringCloser on its own: FIN at once, the close when the client closes, when the
linger is over, or at once past the cap (the served path is in tests/test_edge_gunicorn.py)."""
import socket
import time

import pytest

from app import gunicorn_worker
from app.gunicorn_worker import LingeringCloser


def wait_closed(sock: socket.socket, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while sock.fileno() != -1 and time.monotonic() < deadline:
        time.sleep(0.01)
    return sock.fileno() == -1


@pytest.fixture
def pair():
    server_end, client_end = socket.socketpair()
    yield server_end, client_end
    server_end.close()
    client_end.close()


def test_the_client_reads_the_fin_at_once_and_its_close_ends_the_linger(pair):
    server_end, client_end = pair
    LingeringCloser().close(server_end)
    client_end.settimeout(10)
    assert client_end.recv(1) == b""  # FIN: the reply is complete
    assert server_end.fileno() != -1  # still reading what the client may send
    client_end.sendall(b"late bytes are read, never answered with a reset")
    client_end.close()
    assert wait_closed(server_end)


def test_a_client_that_never_closes_is_let_go_after_the_linger(pair, monkeypatch):
    monkeypatch.setattr(gunicorn_worker, "LINGER_S", 0.2)
    server_end, client_end = pair
    LingeringCloser().close(server_end)
    assert wait_closed(server_end)
    client_end.settimeout(10)
    assert client_end.recv(1) == b""


def test_past_the_cap_a_connection_is_closed_at_once(monkeypatch):
    monkeypatch.setattr(gunicorn_worker, "MAX_LINGERING", 1)
    monkeypatch.setattr(gunicorn_worker, "LINGER_S", 600)
    closer = LingeringCloser()
    pairs = [socket.socketpair() for _ in range(3)]
    try:
        for server_end, _ in pairs:
            closer.close(server_end)
        assert wait_closed(pairs[1][0]) and wait_closed(pairs[2][0])
        assert pairs[0][0].fileno() != -1  # the first one lingers
    finally:
        for ends in pairs:
            for end in ends:
                end.close()

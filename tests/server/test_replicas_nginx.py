"""docs/nginx-replicas.conf, run as it is (ports and log folder substituted) by Debian's nginx in front of two
live lockstep replicas on different ports: REST spreads over both, a socket stays on one replica, and a draining
replica's share goes to the other without a single failed request."""
from pathlib import Path

import pytest

from app.ops.gunicorn_process import free_port
from app.settings import ServerSettings

from ..client import WsClient, http
from .test_edge_nginx import running_nginx

DOCS_CONF = Path(__file__).resolve().parents[2] / "docs" / "nginx-replicas.conf"
DOCS_PORTS = ("127.0.0.1:8001", "127.0.0.1:8002")
SHORT = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}


@pytest.fixture
def replicas_behind_nginx(make_server_for, tiny_model_dir, tmp_path):
    port = free_port()
    settings = ServerSettings(allowed_origins=(f"http://127.0.0.1:{port}",))
    replicas = [make_server_for(tiny_model_dir, settings) for _ in DOCS_PORTS]
    conf = DOCS_CONF.read_text().replace("127.0.0.1:8080", f"127.0.0.1:{port}")
    for docs_port, replica in zip(DOCS_PORTS, replicas):
        conf = conf.replace(docs_port, f"127.0.0.1:{replica.server.server_port}")
    with running_nginx(conf.replace("/var/log/nginx", str(tmp_path)), port, tmp_path) as url:
        yield url, replicas


def finished_requests(replica) -> float:
    """Requests this replica finished, from its own /metrics (asked directly, not through nginx)."""
    text = http("GET", replica.url + "/metrics")[2]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("lockstep:request_success_total{"))


def served_by(replicas, send) -> list[float]:
    """How many requests each replica finished while `send()` ran."""
    before = [finished_requests(r) for r in replicas]
    send()
    return [finished_requests(r) - b for r, b in zip(replicas, before)]


def rest_calls(url: str, count: int) -> None:
    for _ in range(count):
        status, _, body = http("POST", url + "/basic_generate", SHORT)
        assert status == 200 and body["usage"]["completion_tokens"] == 3, body


def socket_requests(url: str, count: int) -> None:
    ws = WsClient(url.replace("http", "ws") + "/ws", origin=url)
    for i in range(count):
        ws.generate(f"r{i}", **SHORT)
        assert ws.collect([f"r{i}"])[f"r{i}"]["final"]["type"] == "done"
    ws.close()


def test_rest_spreads_over_both_replicas_and_a_socket_stays_on_one(replicas_behind_nginx):
    url, replicas = replicas_behind_nginx
    assert all(http("GET", r.url + "/ready")[0] == 200 for r in replicas)
    assert all(count >= 2 for count in served_by(replicas, lambda: rest_calls(url, 6)))
    per_replica = served_by(replicas, lambda: socket_requests(url, 4))
    assert sorted(per_replica) == [0, 4]


def test_a_draining_replica_gets_no_new_work_and_no_request_fails(replicas_behind_nginx):
    url, (draining, staying) = replicas_behind_nginx
    draining.state.begin_drain()  # what SIGTERM starts in a gunicorn worker
    assert http("GET", draining.url + "/ready")[0] == 503
    per_replica = served_by([draining, staying], lambda: (rest_calls(url, 6), socket_requests(url, 2)))
    assert per_replica == [0, 8]


def test_with_no_replica_answering_nginx_says_503_in_locksteps_json(replicas_behind_nginx):
    url, replicas = replicas_behind_nginx
    for replica in replicas:
        replica.server.shutdown()
        replica.server.server_close()  # its port refuses connections now (the fixture stops the engines)
    status, headers, body = http("POST", url + "/basic_generate", SHORT)
    assert (status, body["error"]["code"], headers["Retry-After"]) == (503, "upstream_unavailable", "1")

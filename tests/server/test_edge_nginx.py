"""docs/nginx.conf, run as it is (ports and log folder substituted) by Debian's nginx in front of a live server:
a REST call and a WebSocket stream through it, and no key in its access log."""
import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import openai
import pytest

from app.ops.gunicorn_process import free_port
from app.settings import ServerSettings

from ..client import WsClient, http, wait_for_http

DOCS_CONF = Path(__file__).resolve().parents[2] / "docs" / "nginx.conf"
KEY = "nginx-k3y-5b9a"
WRAPPER = """{user}pid {tmp}/nginx.pid;
error_log {tmp}/error.log;
daemon off;
events {{ worker_connections 256; }}
http {{
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    include {tmp}/lockstep.conf;
}}
"""


@pytest.fixture
def nginx_in_front(make_server_for, tiny_model_dir, tmp_path):
    port = free_port()
    live = make_server_for(tiny_model_dir, ServerSettings(api_key=KEY,
                                                          allowed_origins=(f"http://127.0.0.1:{port}",)))
    conf = (DOCS_CONF.read_text().replace("127.0.0.1:8000", f"127.0.0.1:{live.server.server_port}")
            .replace("127.0.0.1:8080", f"127.0.0.1:{port}").replace("/var/log/nginx", str(tmp_path)))
    with running_nginx(conf, port, tmp_path) as url:
        yield url, tmp_path


@contextlib.contextmanager
def running_nginx(site_conf: str, port: int, tmp_path: Path):
    """nginx with `site_conf` (a docs/ config, ports already replaced) in `tmp_path`; yields its URL."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        pytest.fail("nginx is needed for this test: run `make nginx`")
    (tmp_path / "lockstep.conf").write_text(site_conf)
    user = "user root;\n" if os.geteuid() == 0 else ""  # workers must reach the temporary folders
    (tmp_path / "nginx.conf").write_text(WRAPPER.format(user=user, tmp=tmp_path))
    process = subprocess.Popen([nginx, "-c", str(tmp_path / "nginx.conf"), "-p", str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(url + "/health", process)
        yield url
    finally:
        process.send_signal(signal.SIGQUIT)
        process.wait(10)


def test_rest_and_a_socket_stream_through_nginx(nginx_in_front):
    url, logs = nginx_in_front
    status, _, body = http("POST", url + "/basic_generate", {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
                           headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200 and body["usage"]["completion_tokens"] == 4
    assert http("POST", url + f"/tokenize?api_key={KEY}", {"prompt": "x"})[0] == 401

    ws = WsClient(url.replace("http", "ws") + "/ws", origin=url)  # the browser's Origin: nginx's public one
    ws.send({"type": "auth", "api_key": KEY})
    assert ws.recv() == {"type": "ready"}
    ws.generate("s", prompt="Hello", max_tokens=12, ignore_eos=True)
    result = ws.collect(["s"])["s"]
    assert result["final"]["type"] == "done" and result["final"]["usage"]["completion_tokens"] == 12
    assert sum(e["type"] == "delta" for e in result["events"]) >= 2  # streamed, not buffered into one
    ws.close()

    access_log = (logs / "lockstep.access.log").read_text()
    assert "/basic_generate" in access_log and KEY not in access_log


def test_the_responses_socket_streams_through_nginx_with_the_key_on_its_handshake(nginx_in_front):
    url, _ = nginx_in_front
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    with client.responses.connect() as connection:
        connection.response.create(model="smollm2", input="Hello", max_output_tokens=6, temperature=0)
        kinds = []
        while not kinds or kinds[-1] not in ("response.completed", "response.incomplete", "error"):
            kinds.append(connection.recv().type)
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert kinds.count("response.output_text.delta") >= 2  # streamed, not buffered into one
    response = client.responses.create(model="smollm2", input="Hello", max_output_tokens=3)  # REST, same path
    assert response.usage.output_tokens <= 3


def test_the_page_is_not_rate_limited_the_api_is_and_nginxs_refusals_are_json(nginx_in_front):
    url, _ = nginx_in_front
    page = [http("GET", url + path)[0] for path in ["/", "/health", "/ready"] + ["/static/app.js"] * 30]
    assert set(page) == {200}  # about 20 requests a page load, and a reload at once
    api = [http("GET", url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}) for _ in range(40)]
    refused = [(headers, body) for status, headers, body in api if status == 429]
    assert refused and all(body["error"]["code"] == "rate_limit_exceeded" and headers["Retry-After"] == "1"
                           for headers, body in refused)  # burst 20 at 10 a second: most of 40 at once
    status, _, body = http("POST", url + "/basic_generate", b"x" * (2 << 20),
                           headers={"Authorization": f"Bearer {KEY}"})
    assert (status, body["error"]["code"]) == (413, "request_entity_too_large")
    status, _, body = http("GET", url + "/metrics")
    assert (status, body["error"]["code"]) == (403, "forbidden")  # a scraper reads lockstep's own port

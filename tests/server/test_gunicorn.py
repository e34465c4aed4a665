"""The real thing: `gunicorn -c gunicorn.conf.py wsgi:app` with the embedded model, then a graceful SIGTERM."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from app.ops.gunicorn_process import free_port

from ..client import WsClient, http

REPO = Path(__file__).resolve().parents[2]


def wait_ready(url: str, process, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "gunicorn exited during start-up"
        try:
            if http("GET", url + "/ready", timeout=5)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail("gunicorn never became ready")


@pytest.fixture
def gunicorn(smol_model_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "LOCKSTEP_PORT": str(port), "LOCKSTEP_HTTP_THREADS": "16"}
    log = open(tmp_path / "gunicorn.log", "w+")
    process = subprocess.Popen([str(Path(sys.executable).parent / "gunicorn"), "-c", "gunicorn.conf.py", "wsgi:app"],
                               cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    yield process, f"http://127.0.0.1:{port}", f"ws://127.0.0.1:{port}/ws", log
    if process.poll() is None:
        process.kill()
        process.wait(10)
    log.close()


def test_gunicorn_serves_streams_and_drains_on_sigterm(gunicorn):
    process, url, ws_url, log = gunicorn
    wait_ready(url, process)
    family = [process.pid] + [c.pid for c in psutil.Process(process.pid).children(recursive=True)]
    assert len(family) >= 3  # master, gunicorn worker, model worker

    client = WsClient(ws_url)
    client.generate("chat", messages=[{"role": "system", "content": "You are a helpful assistant."},  # as test_client
                                      {"role": "user", "content": "What is the capital of France?"}],
                    max_tokens=30)
    answer = client.collect(["chat"])["chat"]
    assert "Paris" in answer["text"] and answer["final"]["finish_reason"] == "stop"
    _, _, metrics = http("GET", url + "/metrics")
    assert 'lockstep:request_success_total{finished_reason="stop"} 1.0' in metrics
    _, _, models = http("GET", url + "/v1/models")
    assert models["data"][0]["backend"] == "hf"

    client.generate("long", prompt="Count: 1, 2, 3,", max_tokens=60, ignore_eos=True)
    assert client.recv()["type"] == "start"
    assert client.recv()["type"] == "delta"
    process.send_signal(signal.SIGTERM)
    rest = client.collect(["long"])["long"]
    assert rest["final"]["type"] == "done" and rest["final"]["finish_reason"] == "length"
    assert rest["final"]["usage"]["completion_tokens"] == 60
    client.close()

    assert process.wait(60) == 0
    time.sleep(0.5)
    alive = [pid for pid in family if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    log.seek(0)
    assert alive == [], log.read()[-3000:]

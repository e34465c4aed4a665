"""lockstep_client against the live server: the generator over /ws, one-shot REST, errors, cancel by leaving the
loop, the API key, and the command line (a real subprocess streaming to its stdout)."""
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep_client import Client, LockstepError

from ..client import wait_until

REPO = Path(__file__).resolve().parents[2]
COUNTING = "1, 2, 3, 4,"


@pytest.fixture(scope="module")
def server(smol_server):
    return smol_server


def test_stream_yields_the_same_text_as_rest(server):
    client = Client(server.url)
    streamed = list(client.stream(COUNTING, max_tokens=12))
    assert len(streamed) > 1 and all(isinstance(piece, str) for piece in streamed)
    whole = client.generate(COUNTING, max_tokens=12)
    assert "".join(streamed) == whole.text and "5" in whole.text
    assert whole.finish_reason in ("stop", "length") and whole.usage["completion_tokens"] <= 12


def test_events_end_with_done_and_chat_messages_work(server):
    # with the system prompt of the SDK tests: without it the first token is a near tie on the 4-bit path (0.04 nats)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is the capital of France?"}]
    frames = list(Client(server.url).events(messages=messages, max_tokens=30))
    assert [f["type"] for f in frames[:-1]] == ["delta"] * (len(frames) - 1) and frames[-1]["type"] == "done"
    text = "".join(f["text"] for f in frames[:-1])
    assert "Paris" in text and frames[-1]["finish_reason"] == "stop" and frames[-1]["usage"]["completion_tokens"]
    assert Client(server.url).generate(messages=messages, max_tokens=30).text == text


def test_errors_carry_the_server_code_and_param(server):
    client = Client(server.url)
    with pytest.raises(LockstepError) as over_socket:
        list(client.stream("Hi", temperature=-1))
    with pytest.raises(LockstepError) as over_rest:
        client.generate("Hi", temperature=-1)
    assert (over_socket.value.code, over_socket.value.param) == ("invalid_value", "temperature")
    assert (over_rest.value.code, over_rest.value.param, over_rest.value.status) == (
        "invalid_value", "temperature", 400)
    with pytest.raises(ValueError):
        list(client.stream())


def test_leaving_the_loop_cancels_the_request(server):
    stream = Client(server.url).stream("Write a long story about the sea.", max_tokens=500, ignore_eos=True)
    assert next(stream)
    stream.close()  # what `break` does to a generator
    wait_until(lambda: server.state.engine.num_running == 0, timeout=30, what="the request cancelled")


def test_api_key_over_socket_and_rest(server):
    original = server.state.settings
    server.state.settings = dataclasses.replace(original, api_key="s3cret")
    try:
        assert "".join(Client(server.url, api_key="s3cret").stream(COUNTING, max_tokens=4))
        assert Client(server.url, api_key="s3cret").generate(COUNTING, max_tokens=4).text
        with pytest.raises(LockstepError) as refused:
            Client(server.url, api_key="wrong").generate(COUNTING, max_tokens=4)
        assert (refused.value.status, refused.value.code) == (401, "invalid_api_key")
        with pytest.raises(LockstepError) as refused:
            list(Client(server.url, api_key="wrong").stream(COUNTING, max_tokens=4))
        assert (refused.value.status, refused.value.code) == (401, "connection_refused")
    finally:
        server.state.settings = original


def test_cli_streams_to_stdout(server):
    done = subprocess.run([sys.executable, "-m", "lockstep_client", "--raw", "--max-tokens", "12", "-v",
                           "--url", server.url, COUNTING], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == Client(server.url).generate(COUNTING, max_tokens=12).text.strip()
    assert "completion_tokens" in done.stderr


def test_cli_reports_a_refusal_on_stderr_with_status_1(server):
    done = subprocess.run([sys.executable, "-m", "lockstep_client", "--temperature", "-1", "--url", server.url, "Hi"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "invalid_value" in done.stderr


def test_an_unreachable_server_is_a_clear_error():
    with pytest.raises(LockstepError) as failed:
        list(Client("http://127.0.0.1:9", timeout=5).stream("Hi"))
    assert failed.value.code == "connection_failed"


"""Small real HTTP and WebSocket clients for the live-server tests."""
import json
import time
import urllib.error
import urllib.request

import websocket


def http(method: str, url: str, body=None, content_type: str = "application/json", headers=None, timeout=120):
    """Return (status, headers, parsed JSON or text)."""
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    if data is not None:
        request.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.headers, _parse(response.read(), response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.headers, _parse(error.read(), error.headers)


def _parse(raw: bytes, headers):
    if headers.get_content_type() == "application/json":
        return json.loads(raw)
    return raw.decode()


class WsClient:
    def __init__(self, url: str, timeout: float = 60, **options):
        self.ws = websocket.create_connection(url, timeout=timeout, **options)
        self.received: list[dict] = []  # every message, in arrival order

    def send(self, message):
        self.ws.send(message if isinstance(message, (str, bytes)) else json.dumps(message))

    def recv(self) -> dict:
        self.received.append(json.loads(self.ws.recv()))
        return self.received[-1]

    def generate(self, request_id: str, **fields):
        self.send({"type": "generate", "id": request_id, **fields})

    def collect(self, ids, until=("done", "error")) -> dict:
        """Read until every id in `ids` has finished; return {id: {"text", "events", "final"}}."""
        results = {i: {"text": "", "events": [], "final": None} for i in ids}
        pending = set(ids)
        while pending:
            message = self.recv()
            entry = results[message["id"]]
            entry["events"].append(message)
            if message["type"] == "delta":
                entry["text"] += message["text"]
            elif message["type"] in until:
                entry["final"] = message
                pending.discard(message["id"])
        return results

    def close(self):
        self.ws.close()


def wait_until(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll `predicate` until it holds; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.02)


def wait_for_http(url: str, process, timeout: float = 15.0) -> None:
    """Wait until a server we started answers GET `url`; fail with its output if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            http("GET", url, timeout=2)
            return
        except OSError:
            assert process.poll() is None, process.stdout.read().decode()
            assert time.monotonic() < deadline, f"{url} did not answer within {timeout} s"
            time.sleep(0.1)

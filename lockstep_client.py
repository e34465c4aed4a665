"""A small client for a lockstep server: token streaming over its WebSocket as a generator, one-shot calls over REST.

    from lockstep_client import Client

    client = Client("http://127.0.0.1:8000")  # api_key="..." when the server sets LOCKSTEP_API_KEY
    for text in client.stream(messages=[{"role": "user", "content": "Tell me a joke"}], max_tokens=64):
        print(text, end="", flush=True)
    answer = client.generate("The capital of France is", max_tokens=8)  # REST; answer.text, .finish_reason

Leaving the loop early (break, an exception, Ctrl-C) closes the socket, which cancels the request on the server.
From a shell: `python -m lockstep_client "Tell me a joke"` streams the answer to stdout.

Needs only what the server already installs (simple-websocket for the socket, the standard library for HTTP).
"""
import argparse
import json
import os
import sys
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Iterator
from urllib.parse import urlsplit, urlunsplit

DEFAULT_URL = "http://127.0.0.1:8000"


class LockstepError(Exception):
    """An error answer: `code` and `param` as the server sent them (see docs/api.md's table), `status` over REST."""

    def __init__(self, message: str, code: str = "error", param: str | None = None, status: int | None = None):
        super().__init__(f"{code}: {message}")
        self.message, self.code, self.param, self.status = message, code, param, status


@dataclass(frozen=True)
class Completion:
    text: str | None  # None: the answer is tool calls only
    finish_reason: str  # stop, length, abort or tool_calls
    usage: dict = field(default_factory=dict)
    timing: dict = field(default_factory=dict)
    reasoning: str | None = None  # the model's thinking, where its template has a reasoning block
    tool_calls: list = field(default_factory=list)  # [{id, type, function: {name, arguments}}]


class Client:
    def __init__(self, url: str = DEFAULT_URL, api_key: str | None = None, timeout: float = 120.0):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout  # the longest wait for one frame or one REST answer

    # -- WebSocket: a generator per request -------------------------------------------------------------------

    def stream(self, prompt: str | None = None, *, messages: list | None = None, **fields) -> Iterator[str]:
        """Yield the answer's text piece by piece. `fields` are the server's sampling fields (max_tokens, ...).
        With n > 1 the samples' pieces interleave: `events` tells them apart by each frame's `index`."""
        for frame in self.events(prompt, messages=messages, **fields):
            if frame["type"] == "delta":
                yield frame["text"]

    def events(self, prompt: str | None = None, *, messages: list | None = None, **fields) -> Iterator[dict]:
        """Yield the request's frames as the server sends them: `delta` frames (`text`; where the answer has them,
        `reasoning` and `tool_calls` pieces as OpenAI streams them), then the `done` frame (with finish_reason, usage,
        timing and any finished tool_calls). An `error` frame raises LockstepError."""
        request_id = uuid.uuid4().hex[:12]
        socket = self._connect()
        try:
            socket.send(json.dumps({"type": "generate", "id": request_id, **_input(prompt, messages), **fields}))
            while True:
                frame = self._receive(socket)
                if frame["type"] == "error" and frame.get("id") in (request_id, None):  # None: the socket's own
                    raise LockstepError(frame.get("message", ""), frame.get("code", "error"), frame.get("param"))
                if frame.get("id") != request_id or frame["type"] not in ("delta", "done"):
                    continue  # `start`
                yield frame
                if frame["type"] == "done":
                    return
        finally:
            _close_quietly(socket)

    def _connect(self):
        import simple_websocket  # the server's own dependency; imported when used

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        try:
            return simple_websocket.Client.connect(_ws_url(self.url), headers=headers)
        except simple_websocket.ConnectionError as refused:  # the server answered the handshake with an error
            raise LockstepError(f"the server refused the socket (HTTP {refused.status_code})", "connection_refused",
                                status=refused.status_code) from None
        except OSError as exc:
            raise LockstepError(f"cannot open {_ws_url(self.url)}: {exc}", "connection_failed") from None

    def _receive(self, socket) -> dict:
        from simple_websocket import ConnectionClosed

        try:
            data = socket.receive(timeout=self.timeout)
        except ConnectionClosed as closed:
            raise LockstepError(f"the server closed the socket ({closed.reason})", "connection_closed") from None
        if data is None:
            raise LockstepError(f"no frame within {self.timeout} s", "timeout")
        return json.loads(data)

    # -- REST: one call, one answer ----------------------------------------------------------------------------

    def generate(self, prompt: str | None = None, *, messages: list | None = None, **fields) -> Completion:
        """The whole answer at once: /basic_generate for a prompt, /v1/chat/completions for messages."""
        if messages is None:
            body = self.post("/basic_generate", {**_input(prompt, None), **fields})
            return Completion(body["generated_text"], body["finish_reason"], body["usage"], body.get("timing", {}))
        body = self.post("/v1/chat/completions", {"messages": messages, **fields})
        choice, message = body["choices"][0], body["choices"][0]["message"]
        return Completion(message["content"], choice["finish_reason"], body["usage"],
                          reasoning=message.get("reasoning_content"), tool_calls=message.get("tool_calls", []))

    def post(self, path: str, body: dict) -> dict:
        """POST a JSON body to any endpoint; the parsed answer, or LockstepError with the server's code."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url + path, json.dumps(body).encode(), headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as answer:
            raise _rest_error(answer) from None
        except OSError as exc:
            raise LockstepError(f"cannot reach {self.url}: {exc}", "connection_failed") from None


def _input(prompt: str | None, messages: list | None) -> dict:
    if (prompt is None) == (messages is None):
        raise ValueError("give a prompt or messages (one of them)")
    return {"prompt": prompt} if messages is None else {"messages": messages}


def _ws_url(url: str) -> str:
    parts = urlsplit(url)
    scheme = "wss" if parts.scheme == "https" else "ws"
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") + "/ws", "", ""))


def _rest_error(answer: urllib.error.HTTPError) -> LockstepError:
    try:
        error = json.loads(answer.read())["error"]
        return LockstepError(error["message"], error["code"], error.get("param"), answer.code)
    except (ValueError, KeyError, TypeError):
        return LockstepError(f"HTTP {answer.code}", "http_error", status=answer.code)


def _close_quietly(socket) -> None:
    from simple_websocket import ConnectionClosed

    try:
        socket.close()
    except (ConnectionClosed, OSError):  # closed by the server already
        pass


# -- command line -------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    fields = {name: value for name, value in (("max_tokens", args.max_tokens), ("temperature", args.temperature),
                                              ("seed", args.seed)) if value is not None}
    client = Client(args.url, args.api_key or os.environ.get("LOCKSTEP_API_KEY"), args.timeout)
    if args.raw:
        frames = client.events(prompt, **fields)
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        frames = client.events(messages=[*system, {"role": "user", "content": prompt}], **fields)
    try:
        for frame in frames:
            if frame["type"] == "delta":
                if frame.get("reasoning") and args.verbose:  # the model's thinking, apart from the answer
                    sys.stderr.write(frame["reasoning"])
                sys.stdout.write(frame["text"])
                sys.stdout.flush()
            elif args.verbose:
                print(f"\n[{frame['finish_reason']}] {json.dumps(frame['usage'])} {json.dumps(frame['timing'])}",
                      file=sys.stderr)
    except LockstepError as error:
        print(f"\nerror: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the generator closes the socket: the server cancels the request
        return 130
    print()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m lockstep_client",
                                     description="Stream an answer from a lockstep server over its WebSocket.")
    parser.add_argument("prompt", help="the question (a chat message), or - to read it from stdin")
    parser.add_argument("--url", default=os.environ.get("LOCKSTEP_URL", DEFAULT_URL),
                        help=f"the server (default: $LOCKSTEP_URL or {DEFAULT_URL})")
    parser.add_argument("--api-key", help="the server's key (default: $LOCKSTEP_API_KEY)")
    parser.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    parser.add_argument("--system", help="a system message")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--timeout", type=float, default=120.0, help="the longest wait for one frame, in seconds")
    parser.add_argument("-v", "--verbose", action="store_true", help="print finish reason, usage and timing to stderr")
    return parser


if __name__ == "__main__":
    sys.exit(main())

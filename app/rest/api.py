"""REST: the original design's endpoints and an OpenAI-compatible, non-streaming subset.

A REST call waits for its requests with a timeout and looks at its client's socket in between:
a client that hung up gets its requests cancelled instead of keeping the batch busy.
"""
import logging
import queue
import socket
import time
import uuid

from flask import Blueprint, g, jsonify, request

from engine import FinishReason, RequestHandle, RequestOutput, SamplingParams, Usage, WorkerFailed

from ..errors import ApiError, from_failed_output
from ..state import lockstep
from .answer_shaping import chat_choices, completion_choices, sample_choices
from .chat_request import chat_request
from .request_parsing import (BASIC_GENERATE, CHAT, COMPLETIONS, GENERATE, TOKENIZE, completion_prompts,
                              messages_field, prompt_field, prompts_field, read_json_body, sampling_fields)

logger = logging.getLogger(__name__)

bp = Blueprint("api", __name__)

CLIENT_CHECK_S = 0.25  # how often a waiting call looks whether its client is still connected
CANCEL_WAIT_S = 1.0  # how long a cancelled call waits for its requests' final counts

OPENAI_DEFAULT_MAX_TOKENS = 16  # what OpenAI's completions endpoint uses when max_tokens is absent


@bp.post("/basic_generate")
def basic_generate():
    body = read_json_body(BASIC_GENERATE)
    prompt = prompt_field(body)
    sampling = sampling_fields(body, lockstep().engine)
    output = run_one(prompt=prompt, body=body, sampling=sampling)
    extra = {}
    if sampling.n > 1 or sampling.logprobs is not None:
        extra["choices"] = sample_choices(output, sampling, lockstep().engine.token_texts)
    return jsonify(generated_text=output.text, finish_reason=output.finish_reason.value,
                   usage=output.usage.as_dict(), timing=output.timings.as_dict(), **extra)


@bp.post("/generate")
def generate():
    body = read_json_body(GENERATE)
    prompts = prompts_field(body, lockstep().max_prompts)
    sampling = sampling_fields(body, lockstep().engine)
    outputs = _run_many(prompts, body, sampling=sampling)
    extra = {}
    if sampling.n > 1 or sampling.logprobs is not None:  # per prompt, its samples
        extra["choices"] = [sample_choices(o, sampling, lockstep().engine.token_texts) for o in outputs]
    return jsonify(generated_texts=[o.text for o in outputs],
                   finish_reasons=[o.finish_reason.value for o in outputs],
                   usage=_total_usage(outputs), **extra)


@bp.post("/v1/completions")
def completions():
    body = read_json_body(COMPLETIONS)
    prompts = completion_prompts(body, lockstep().max_prompts)
    sampling = sampling_fields(body, lockstep().engine, OPENAI_DEFAULT_MAX_TOKENS)
    outputs = _run_many(prompts, body, sampling=sampling)
    choices = completion_choices(outputs, prompts, sampling, lockstep().engine.token_texts)
    return jsonify(_openai_envelope("cmpl", "text_completion", choices, outputs))


@bp.post("/v1/chat/completions")
def chat_completions():
    engine = lockstep().engine
    body = read_json_body(CHAT, engine.max_model_len)
    chat = chat_request(body, engine)
    output = run_one(messages=chat.messages, body=body, sampling=chat.sampling, tools=chat.template_tools,
                     thinking=chat.thinking)
    choices = chat_choices(output, chat.sampling, engine.token_texts, chat.shape)
    return jsonify(_openai_envelope("chatcmpl", "chat.completion", choices, [output]))


@bp.get("/v1/models")
def models():
    state = lockstep()
    return jsonify(object="list", data=[state.model_card()])


@bp.get("/v1/models/<path:model_id>")
def model(model_id: str):
    card = lockstep().model_card()
    if _slashes_merged(model_id) != _slashes_merged(card["id"]):
        raise ApiError(404, f"no model {model_id[:200]!r} here; GET /v1/models lists the one served",
                       "model_not_found", "model")
    return jsonify(card)


@bp.post("/tokenize")
def tokenize():
    body = read_json_body(TOKENIZE)
    engine = lockstep().engine
    if "messages" in body:
        token_ids = engine.encode(messages=messages_field(body))
    else:
        token_ids = engine.encode(prompt=prompt_field(body))
    return jsonify(tokens=token_ids, count=len(token_ids), max_model_len=engine.max_model_len)


def run_one(body: dict, sampling: SamplingParams, prompt: str | None = None,
            messages: list | None = None, tools: list[dict] | None = None,
            thinking: bool | None = None) -> RequestOutput:
    engine = lockstep().engine
    handle = engine.submit(prompt, sampling, messages=messages, client_id=client_address(),
                           timeout_s=body.get("timeout"), cache_salt=body.get("cache_salt"), tools=tools,
                           thinking=thinking)
    return _checked(_wait_while_connected([handle]))[0]


def _run_many(prompts: list[str], body: dict, sampling: SamplingParams) -> list[RequestOutput]:
    engine = lockstep().engine
    handles = engine.submit_many(prompts, sampling, client_id=client_address(), timeout_s=body.get("timeout"),
                                 cache_salt=body.get("cache_salt"))
    return _checked(_wait_while_connected(handles))


def _slashes_merged(model_id: str) -> str:
    """A model id may be a directory; in a URL its slashes are merged (/v1/models//abs/path -> abs/path)."""
    return "/".join(part for part in model_id.split("/") if part)


def client_address() -> str:
    """Who is asking, for fair admission: the peer address, or behind a trusted proxy (LOCKSTEP_TRUSTED_PROXIES)
    the last X-Forwarded-For address that is not one of those proxies (earlier entries are the client's word)."""
    peer = request.remote_addr or ""
    trusted = lockstep().settings.trusted_proxies
    if peer not in trusted:
        return peer
    forwarded = [a.strip() for a in request.headers.get("X-Forwarded-For", "").split(",") if a.strip()]
    return next((a for a in reversed(forwarded) if a not in trusted), peer)[:64]


class ClientGone(ApiError):
    """The REST client closed its connection while its requests ran (nobody reads this answer; it is logged)."""

    def __init__(self):
        super().__init__(499, "the client closed the connection", "client_closed_request")


def _wait_while_connected(handles: list[RequestHandle]) -> list[RequestOutput]:
    """Every handle's output, in order; cancels them all if the client hangs up (or anything goes wrong)."""
    client = request.environ.get("gunicorn.socket") or request.environ.get("werkzeug.socket")
    try:
        return [_wait_for(handle, client) for handle in handles]
    except ClientGone:
        _cancel(handles)
        g.completion_tokens = _tokens_before_cancel(handles)  # for the access log's line
        logger.info("client %s went away; cancelled %d request(s)", client_address(), len(handles))
        raise
    finally:
        _cancel(handles)  # a no-op for the finished and the cancelled ones


def _wait_for(handle: RequestHandle, client: socket.socket | None) -> RequestOutput:
    while True:
        try:
            return handle.result(timeout=CLIENT_CHECK_S)
        except queue.Empty:
            if client is not None and has_hung_up(client):
                raise ClientGone() from None


def _tokens_before_cancel(handles: list[RequestHandle]) -> int:
    """The tokens the cancelled requests produced: their final outputs come at the scheduler's next step."""
    total = 0
    for handle in handles:
        try:
            total += handle.result(timeout=CANCEL_WAIT_S).usage.completion_tokens
        except (queue.Empty, WorkerFailed):
            break  # the count is for a log line; never hold the thread for it
    return total


def has_hung_up(client: socket.socket) -> bool:
    """True when the peer closed: a non-blocking peek returns no bytes (EOF) or fails. Nothing to read, or
    bytes waiting (a pipelined request), mean the client is still there. (No select(): with a thousand
    threads a descriptor may be above select's limit of 1024.)"""
    try:
        return client.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


def _cancel(handles: list[RequestHandle]) -> None:
    for handle in handles:
        handle.cancel()


def _checked(outputs: list[RequestOutput]) -> list[RequestOutput]:
    g.completion_tokens = sum(o.usage.completion_tokens for o in outputs)
    for output in outputs:
        if output.finish_reason is FinishReason.ERROR:
            raise from_failed_output(output)
    return outputs


def _total_usage(outputs: list[RequestOutput]) -> dict:
    return Usage(sum(o.usage.prompt_tokens for o in outputs), sum(o.usage.completion_tokens for o in outputs),
                 sum(o.usage.cached_tokens for o in outputs)).as_dict()


def _openai_envelope(prefix: str, obj: str, choices: list, outputs: list[RequestOutput]) -> dict:
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": lockstep().model_name, "choices": choices, "usage": _total_usage(outputs)}


"""Reading request bodies: shared by REST and WebSocket so both refuse the same things the same way."""
import dataclasses
import json

from flask import current_app, request

from engine import InvalidRequest, SamplingParams
from engine.inputs import check_encodable

from .errors import BODY_READ_ERRORS, ApiError, missing_field

ROLES = ("system", "user", "assistant")
MAX_MESSAGES = 256


def read_json_body() -> dict:
    """The request body as a JSON object, or a 400 that says what is wrong with it (413 when too large)."""
    if request.mimetype != "application/json":
        raise ApiError(400, "send a JSON body with Content-Type: application/json", "invalid_content_type")
    try:
        raw = request.get_data(cache=False)
    except BODY_READ_ERRORS:
        raise ApiError(400, "the request body could not be read (bad chunked encoding?)", "invalid_body") from None
    # MAX_CONTENT_LENGTH is the limit + 1: a chunked body is read up to it, so one byte more means too large
    # (werkzeug stops a chunked body at the limit without an error).
    if len(raw) >= current_app.config["MAX_CONTENT_LENGTH"]:
        raise ApiError(413, "the request body is too large", "request_entity_too_large")
    return parse_json_object(raw)


def parse_json_object(raw: bytes | str) -> dict:
    try:
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        body = json.loads(text)
    except UnicodeDecodeError:
        raise ApiError(400, "the body is not valid UTF-8", "invalid_utf8") from None
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc.msg} at position {exc.pos}", "invalid_json") from None
    except (ValueError, RecursionError):  # an integer of thousands of digits; nesting deeper than the parser
        raise ApiError(400, "the body is JSON that this server will not read (too deep or a huge number)",
                       "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object", "invalid_json")
    return body


def prompt_field(body: dict, name: str = "prompt") -> str:
    value = body.get(name)
    if value is None:
        raise missing_field(name)
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string", name)
    if not value.strip():
        raise InvalidRequest(f"{name} must not be empty", name)
    check_encodable(value, name)
    return value


def prompts_field(body: dict, max_prompts: int, name: str = "prompts") -> list[str]:
    value = body.get(name)
    if value is None:
        raise missing_field(name)
    if not isinstance(value, list) or not value:
        raise InvalidRequest(f"{name} must be a non-empty list of strings", name)
    if len(value) > max_prompts:
        raise InvalidRequest(f"at most {max_prompts} prompts per request", name)
    return [prompt_field({name: p}, name) for p in value]


def messages_field(body: dict) -> list[dict]:
    messages = body.get("messages")
    if messages is None:
        raise missing_field("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} messages", "messages")
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ROLES \
                or not isinstance(message.get("content"), str):
            raise InvalidRequest(f"each message needs a role ({', '.join(ROLES)}) and a string content",
                                 "messages")
    for index, message in enumerate(messages):
        check_encodable(message["content"], "messages", f"messages[{index}].content")
    if not any(m["content"].strip() for m in messages if m["role"] == "user"):
        raise InvalidRequest("messages need at least one non-empty user message", "messages")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def sampling_fields(body: dict, engine, default_max_tokens: int | None = None) -> SamplingParams:
    params = SamplingParams.from_request(body, engine.config.max_stop_strings)
    if params.max_tokens is None and default_max_tokens is not None:
        params = dataclasses.replace(params, max_tokens=default_max_tokens)
    return params

"""Reading request bodies: shared by REST and WebSocket so both refuse the same things the same way.

Every request kind lists the fields it reads; any other field is refused (400 `unsupported_field`, `param` naming
it), so that no field is silently ignored. OpenAI's optional fields count as absent when null, as OpenAI reads them.
"""
import dataclasses
import json
import re
from dataclasses import dataclass, field

from flask import current_app, request

from engine import InvalidRequest, SamplingParams, check_encodable

from ..errors import BODY_READ_ERRORS, ApiError, invalid_value, missing_field, unsupported_field

ROLES = ("system", "user", "assistant", "developer")
ROLE_AS = {"developer": "system"}  # OpenAI's newer name for the system role
MAX_MESSAGES = 256
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits
MAX_PARAM_CHARS = 64  # a field name echoed back in an error (names are the client's: keep them short)
STREAM_HINT = ("streaming is served over WebSocket: OpenAI clients through the Responses API's WebSocket mode "
               "(ws://HOST/v1/responses; the official SDK: client.responses.connect()), others at /ws (see "
               "docs/api.md); send \"stream\": false or omit it")

# What the engine's SamplingParams reads (including what the sampling and JSON-mode work adds), on every endpoint.
SAMPLING = frozenset({
    "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "ignore_eos", "timeout",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "n", "best_of",
    "logprobs", "top_logprobs", "echo", "response_format",
})
# vLLM's field: requests share cached prompt prefixes only with requests of the same salt (docs/api.md: prefix cache).
CACHE_SALT = frozenset({"cache_salt"})
# vLLM's field: arguments for the chat template (of them, enable_thinking: app/rest/chat_request.py).
TEMPLATE_ARGS = frozenset({"chat_template_kwargs"})
# OpenAI fields read for information only (never change the answer), and `stream`, whose only accepted value
# on REST is false.
OPENAI_COMMON = frozenset({"model", "user", "metadata", "store", "stream"})
# OpenAI fields this server does not implement, with why: refused when given a value (null counts as absent).
NOT_IMPLEMENTED = {
    "tools": "tools (function calling) are not supported; send no tools or an empty list",
    "tool_choice": "tool_choice is not supported (only \"none\"): this server does not call tools",
    "functions": "functions (function calling) are not supported",
    "function_call": "function_call is not supported: this server does not call functions",
    "parallel_tool_calls": "parallel_tool_calls is not supported: this server does not call tools",
    "suffix": "suffix (insertion) is not supported",
    "audio": "audio output is not supported",
    "modalities": "modalities are not supported: this server answers text only",
    "stream_options": "stream_options apply to streaming, which REST does not serve (use the WebSocket at /ws)",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning_effort is not supported by this model",
    "web_search_options": "web search is not supported",
    "service_tier": "service_tier is not supported",
    "prompt_cache_key": "prompt_cache_key is not supported",
    "safety_identifier": "safety_identifier is not supported",
    "verbosity": "verbosity is not supported",
}
# Values of an unimplemented field that mean "not used" and so are accepted.
NOT_USED = {"tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (False,)}
# Sampling fields only some endpoints serve: elsewhere refused by name with where to send them (false is accepted:
# it asks for nothing).
SERVED_ELSEWHERE = {"echo": "echo (the prompt, with its logprobs, before the answer) is served by /v1/completions only"}
# Message fields that only carry tool calls or outputs: accepted when null or empty, like the SDK sends them.
MESSAGE_TOOL_FIELDS = ("tool_calls", "function_call", "audio", "refusal", "annotations", "tool_call_id")
TOOL_FIELDS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})  # chat completions reads them
MAX_CALL_ID = 64


@dataclass(frozen=True)
class RequestShape:
    """The fields one kind of request reads; `aliases` name another spelling of a field (OpenAI renamed some)."""

    name: str
    fields: frozenset
    aliases: dict = field(default_factory=dict)
    is_openai: bool = False  # OpenAI's unimplemented fields get their own message (and null counts as absent)
    one_of: tuple[str, ...] = ()  # at most one of these may be given
    not_implemented: dict = field(default_factory=lambda: NOT_IMPLEMENTED)  # OpenAI's fields refused, with why
    not_used: dict = field(default_factory=lambda: NOT_USED)  # their values that ask for nothing (accepted)
    stream_hint: str = STREAM_HINT  # what `stream: true` is told
    keeps_responses: bool = False  # `store: true` is served (the Responses API keeps what it answers)

    def accepts(self, name: str) -> bool:
        return name in self.fields or name in self.aliases


BASIC_GENERATE = RequestShape("/basic_generate", SAMPLING - {"echo"} | CACHE_SALT | {"prompt"})
GENERATE = RequestShape("/generate", SAMPLING - {"echo"} | CACHE_SALT | {"prompts"})
COMPLETIONS = RequestShape("/v1/completions", SAMPLING | CACHE_SALT | OPENAI_COMMON | {"prompt"}, is_openai=True)
CHAT = RequestShape("/v1/chat/completions",
                    SAMPLING - {"echo"} | CACHE_SALT | OPENAI_COMMON | TOOL_FIELDS | TEMPLATE_ARGS | {"messages"},
                    aliases={"max_completion_tokens": "max_tokens"}, is_openai=True,
                    not_implemented={k: v for k, v in NOT_IMPLEMENTED.items() if k not in TOOL_FIELDS})
TOKENIZE = RequestShape("/tokenize", frozenset({"prompt", "messages", "model"}), one_of=("prompt", "messages"))
WS_GENERATE = RequestShape("a generate frame", SAMPLING - {"echo"} | CACHE_SALT | TOOL_FIELDS | TEMPLATE_ARGS
                           | {"type", "id", "prompt", "messages"}, one_of=("prompt", "messages"),
                           not_implemented={k: v for k, v in NOT_IMPLEMENTED.items() if k not in TOOL_FIELDS})


def read_json_body(shape: RequestShape | None = None, context: int = 0) -> dict:
    """The request body as a JSON object, or a 400 that says what is wrong with it (413 when too large).
    With a `shape`, its fields are checked (see `checked_fields`)."""
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
    body = parse_json_object(raw)
    refuse_lone_surrogates(body, raw)
    return body if shape is None else checked_fields(body, shape, context)


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


# How a surrogate gets past a strict UTF-8 decode: only as an escape (a JSON frame is str, a body bytes).
_SURROGATE_ESCAPE = {str: re.compile(r"\\u[dD][89a-fA-F]"), bytes: re.compile(rb"\\u[dD][89a-fA-F]")}


def refuse_lone_surrogates(body: dict, raw: bytes | str) -> None:
    """JSON's "\\ud800" decodes to a lone surrogate, which no UTF-8 codec takes (a tokenizer, the prefix cache's
    hash, a strict client reading it echoed back): refused for every field's value, nested ones included, so none
    reaches the engine. A field's name is left to the field checks (an unknown name is refused there)."""
    if not _SURROGATE_ESCAPE[type(raw)].search(raw):
        return
    for name, value in body.items():
        if not _is_unicode(value):
            shown = shown_name(name)
            raise invalid_value(shown, f"{shown} holds text that is not valid Unicode: a lone surrogate "
                                       "(a \\ud800-\\udfff escape outside a pair)")


def _is_unicode(value) -> bool:
    """Whether every string in a parsed JSON value (keys too) encodes to UTF-8: json's C encoder tells at C speed;
    a value nested deeper than its stack allows here is walked instead."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False
    except RecursionError:
        pending = [value]
        while pending:
            item = pending.pop()
            if isinstance(item, str) and not _is_unicode(item):
                return False
            if isinstance(item, dict):
                pending.extend((*item.keys(), *item.values()))
            elif isinstance(item, list):
                pending.extend(item)
        return True


def echoable(value, max_length: int) -> str | None:
    """A client's id fit to send back in an error frame: a string of at most `max_length` valid characters."""
    return value if isinstance(value, str) and len(value) <= max_length and _is_unicode(value) else None


# -- which fields ---------------------------------------------------------------------------------------------

def checked_fields(body: dict, shape: RequestShape, context: int = 0) -> dict:
    """The body with aliases resolved, or a 400 for the first field `shape` does not read, an unimplemented
    OpenAI field, `stream: true`, or an alias that disagrees with the field it stands for or asks more tokens than
    the model's `context` (0: not known yet), named as sent (the engine checks the field it stands for)."""
    for name, value in body.items():
        _check_field(name, value, shape)
    given = [name for name in shape.one_of if name in body]
    if len(given) > 1:
        raise invalid_value(given[1], f"give {' or '.join(shape.one_of)}, not both")
    return _resolve_aliases(body, shape, context)


def _is_null_or_false(value) -> bool:
    """By identity: 0 and 0.0 equal False in Python but are not JSON's false."""
    return value is None or value is False


def _check_field(name: str, value, shape: RequestShape) -> None:
    if shape.is_openai and name in shape.not_implemented:
        if value is None or any(value == used and type(value) is type(used) for used in shape.not_used.get(name, ())):
            return
        raise unsupported_field(name, shape.not_implemented[name])
    if name in SERVED_ELSEWHERE and not shape.accepts(name):
        if _is_null_or_false(value):
            return
        raise unsupported_field(name, SERVED_ELSEWHERE[name])
    if not shape.accepts(name):
        shown = shown_name(name)
        raise unsupported_field(shown, f"unknown field {shown!r}: {shape.name} does not read it")
    if name == "stream" and not _is_null_or_false(value):
        if value is not True:
            raise invalid_value("stream", "stream must be true or false")
        raise unsupported_field("stream", shape.stream_hint)
    if name in ("model", "user") and value is not None and not isinstance(value, str):
        raise invalid_value(name, f"{name} must be a string")
    if name == "metadata":
        metadata_field(value)
    if name == "store" and not _is_null_or_false(value) and not shape.keeps_responses:
        raise unsupported_field("store", "store is not supported: this server keeps no completions (send false)")


def metadata_field(value) -> dict:
    """OpenAI's `metadata`: null, or at most 16 pairs of short strings (read for information only, or echoed)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        raise invalid_value("metadata", f"metadata must be an object of at most {MAX_METADATA_PAIRS} pairs")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
            raise invalid_value("metadata", f"metadata keys are at most {MAX_METADATA_KEY} characters and values "
                                            f"strings of at most {MAX_METADATA_VALUE}")
        check_encodable(key, "metadata")
        check_encodable(item, "metadata")
    return value


def _resolve_aliases(body: dict, shape: RequestShape, context: int) -> dict:
    for alias, name in shape.aliases.items():
        if body.get(alias) is None:
            continue
        if not _is_int(body[alias]) or body[alias] < 1:
            raise invalid_value(alias, f"{alias} must be an integer of at least 1")
        if context and body[alias] > context:
            raise invalid_value(alias, f"{alias} must be at most {context} (the model's context length)")
        if body.get(name) is not None and body[name] != body[alias]:
            raise invalid_value(alias, f"{alias} and {name} are the same limit: send one, or the same value")
        body = {**{k: v for k, v in body.items() if k != alias}, name: body[alias]}
    return body


def shown_name(name: str) -> str:
    """A field name fit to echo back: at most MAX_PARAM_CHARS characters, lone surrogates replaced."""
    return name[:MAX_PARAM_CHARS].encode("utf-8", "replace").decode("utf-8")


# -- prompts --------------------------------------------------------------------------------------------------

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
    _check_num_prompts(value, max_prompts, name)
    return [prompt_field({name: p}, name) for p in value]


def completion_prompts(body: dict, max_prompts: int) -> list[str | list[int]]:
    """/v1/completions' `prompt`, as OpenAI takes it: a string, a list of strings, a list of token ids, or a list
    of token-id lists. Token ids are checked against the vocabulary by the engine."""
    value = body.get("prompt")
    if not isinstance(value, list):
        return [prompt_field(body)]
    if value and all(_is_int(i) for i in value):
        return [value]
    if value and all(isinstance(p, list) for p in value):
        _check_num_prompts(value, max_prompts, "prompt")
        if not all(p and all(_is_int(i) for i in p) for p in value):
            raise InvalidRequest("each token-id prompt must be a non-empty list of integers", "prompt")
        return value
    if value and any(_is_int(p) or isinstance(p, list) for p in value):
        raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids or a list of "
                             "token-id lists (not a mix)", "prompt")
    return prompts_field(body, max_prompts, "prompt")


def _check_num_prompts(prompts: list, max_prompts: int, name: str) -> None:
    if len(prompts) > max_prompts:
        raise InvalidRequest(f"at most {max_prompts} prompts per request", name)


def _is_int(value) -> bool:
    return type(value) is int


# -- chat messages --------------------------------------------------------------------------------------------

def messages_field(body: dict, with_tools: bool = False) -> list[dict]:
    """The messages as {role, content} with plain-text content: `developer` becomes `system`, text parts are
    joined, a message's `name` is accepted and not used (the chat template has no place for it). `with_tools`
    (chat completions): assistant messages may carry `tool_calls` (content null), and `tool` messages answer
    them by `tool_call_id`."""
    messages = body.get("messages")
    if messages is None:
        raise missing_field("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("messages must be a non-empty list of {role, content} objects", "messages")
    if len(messages) > MAX_MESSAGES:
        raise InvalidRequest(f"at most {MAX_MESSAGES} messages", "messages")
    plain = [_tool_message(message, index) if with_tools and _is_tool_message(message)
             else _plain_message(message, index) for index, message in enumerate(messages)]
    check_conversation(plain, "messages")
    if with_tools:
        check_call_ids(plain)
    return plain


def check_conversation(plain: list[dict], name: str) -> None:
    """Plain {role, content} messages a chat template can take: Unicode text, and some text in one of them (any
    role: a system message alone is a prompt, as OpenAI's and vLLM's servers take it)."""
    for index, message in enumerate(plain):
        check_encodable(message["content"] or "", name, f"{name}[{index}].content")
    if not any((m["content"] or "").strip() or m.get("tool_calls") for m in plain):
        raise InvalidRequest(f"{name} need at least one message with text (not only whitespace)", name)


def _plain_message(message, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        role = message.get("role") if isinstance(message, dict) else None
        if role == "tool":
            raise unsupported_field("messages", f"{where}: tool messages are read by /v1/chat/completions only")
        if isinstance(role, str):
            raise InvalidRequest(f"{where}.role {shown_name(role)!r} is not one of {', '.join(ROLES)}", "messages")
        raise InvalidRequest(f"each message needs a role ({', '.join(ROLES)}) and a content; {where} has none",
                             "messages")
    for name, value in message.items():
        _check_message_field(name, value, where)
    return {"role": ROLE_AS.get(message["role"], message["role"]), "content": _content_text(message, where)}


def _is_tool_message(message) -> bool:
    return isinstance(message, dict) and (message.get("role") == "tool" or (
        message.get("role") == "assistant" and message.get("tool_calls") not in (None, [])))


def _tool_message(message: dict, index: int) -> dict:
    """A tool's result, or an assistant's calls, in the shape engine/tool_calls.py renders."""
    where = f"messages[{index}]"
    known = {"role", "content", "name"} | ({"tool_call_id"} if message["role"] == "tool" else
                                           {"tool_calls", "refusal", "audio", "function_call", "annotations"})
    unknown = sorted(set(message) - known)
    if unknown:
        raise unsupported_field("messages", f"{where}: unknown message field {shown_name(unknown[0])!r}")
    if not isinstance(message.get("name", ""), str):
        raise invalid_value("messages", f"{where}.name must be a string")
    unread = next((name for name in ("refusal", "audio", "function_call", "annotations")
                   if message.get(name) is not None), None)
    if unread is not None:
        raise unsupported_field("messages", f"{where}.{unread} is not read; send it null")
    if message["role"] == "tool":
        call_id = checked_call_id(message.get("tool_call_id"), f"{where}.tool_call_id", "messages")
        return {"role": "tool", "content": _content_text(message, where), "tool_call_id": call_id}
    content = message.get("content")
    return {"role": "assistant", "content": None if content is None else _content_text(message, where),
            "tool_calls": [_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(message["tool_calls"])]}


def _call(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or call.get("type") != "function":
        raise invalid_value("messages", f"{where} must be {{\"id\", \"type\": \"function\", \"function\": "
                                        "{\"name\", \"arguments\"}}")
    return checked_call((call.get("id"), f"{where}.id"), (function.get("name"), f"{where}.function.name"),
                        (function.get("arguments"), f"{where}.function.arguments"), "messages")


def checked_call(call_id: tuple, name: tuple, arguments: tuple, param: str) -> dict:
    """An earlier tool call sent back (chat's tool_calls, Responses' function_call items), each part given as
    (value, where it was) so that a refusal names it: as engine/tool_calls.py renders calls."""
    (name_value, name_at), (arguments_value, arguments_at) = name, arguments
    if not isinstance(name_value, str) or not 0 < len(name_value) <= 64:
        raise invalid_value(param, f"{name_at} must be a string of 1 to 64 characters")
    if not isinstance(arguments_value, str) or not isinstance(_json_or_none(arguments_value), dict):
        raise invalid_value(param, f"{arguments_at} must be a JSON object as text")
    return {"id": checked_call_id(*call_id, param), "type": "function",
            "function": {"name": name_value, "arguments": arguments_value}}


def checked_call_id(value, where: str, param: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_CALL_ID:
        raise invalid_value(param, f"{where} must be a call's id: a string of 1 to {MAX_CALL_ID} characters")
    return value


def _json_or_none(text: str):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def check_call_ids(messages: list[dict], param: str = "messages") -> None:
    """Each tool message answers a call made earlier in the conversation (OpenAI refuses one that does not)."""
    made = set()
    for index, message in enumerate(messages):
        made.update(call["id"] for call in message.get("tool_calls") or ())
        if message["role"] == "tool" and message["tool_call_id"] not in made:
            raise invalid_value(param, f"{param}[{index}]: the call id {shown_name(message['tool_call_id'])!r} "
                                       "answers no earlier tool call")


def _check_message_field(name: str, value, where: str) -> None:
    if name in ("role", "content"):
        return
    if name == "name":
        if not isinstance(value, str):
            raise invalid_value("messages", f"{where}.name must be a string")
        return
    if name in MESSAGE_TOOL_FIELDS:
        if value is not None and value != []:
            raise unsupported_field("messages", f"{where}.{name} is not read here (tool calls: /v1/chat/completions; "
                                                "no audio)")
        return
    raise unsupported_field("messages", f"{where}: unknown message field {shown_name(name)!r}")


def _content_text(message: dict, where: str) -> str:
    """A string content as it is; a list of text parts joined by newlines (as vLLM does); anything else refused.
    A null content would only make sense beside tool calls, which this server does not make."""
    return content_text(message.get("content"), where, CHAT_PARTS)


@dataclass(frozen=True)
class ContentParts:
    """The parts a message's content may hold (chat's text parts; the Responses API's input and output text)."""

    param: str  # the field errors name
    types: tuple[str, ...]
    empty_fields: frozenset = frozenset()  # fields read back from an answer: accepted when empty


CHAT_PARTS = ContentParts("messages", ("text",))


def content_text(content, where: str, parts: ContentParts) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        raise invalid_value(parts.param, f"{where}.content is null: this server needs text in every message "
                                         "(a null content only goes with tool calls, which it does not support)")
    if not isinstance(content, list) or not content:
        raise invalid_value(parts.param, f"{where}.content must be a string or a non-empty list of text parts")
    return "\n".join(_text_part(part, f"{where}.content[{i}]", parts) for i, part in enumerate(content))


def _text_part(part, where: str, parts: ContentParts) -> str:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise invalid_value(parts.param, f"{where} must be an object with a type")
    if part["type"] not in parts.types:
        raise unsupported_field(parts.param, f"{where} is a {shown_name(part['type'])!r} part; only "
                                             f"{' and '.join(parts.types)} parts are supported")
    if not isinstance(part.get("text"), str):
        raise invalid_value(parts.param, f"{where}.text must be a string")
    extra = set(part) - {"type", "text"} - parts.empty_fields
    if extra:
        raise unsupported_field(parts.param, f"{where}: unknown part field {shown_name(sorted(extra)[0])!r}")
    if any(part.get(name) for name in parts.empty_fields):
        raise unsupported_field(parts.param, f"{where}: {' and '.join(sorted(parts.empty_fields))} are not read; "
                                             "send them empty")
    return part["text"]


# -- sampling -------------------------------------------------------------------------------------------------

def max_output_chars(engine) -> int | None:
    """The most characters an answer can hold (it bounds schemas' counts); None before the engine starts."""
    return engine.inputs.max_prompt_chars if engine.inputs else None


def sampling_fields(body: dict, engine, default_max_tokens: int | None = None) -> SamplingParams:
    params = SamplingParams.from_request(body, engine.config.max_stop_strings, max_output_chars(engine))
    if params.max_tokens is None and default_max_tokens is not None:
        params = dataclasses.replace(params, max_tokens=default_max_tokens)
    return params

"""GET /openapi.json: an OpenAPI 3.1 description of what this server does, built from the same lists the server
checks requests against (app/rest/request_parsing.py) and the limits of the running instance (stop strings, prompts per
call).

Request bodies are closed (`additionalProperties: false`): the server refuses any other field. Responses are open:
they list what is always there. tests/server/test_openapi.py runs schemathesis against the live server with this
document.
"""
from flask import Blueprint, jsonify

from engine import (MAX_CACHE_SALT_CHARS, MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_ENTRIES, MAX_LOGPROBS, MAX_PENALTY,
                    MAX_SCHEMA_NAME_LENGTH, MAX_SEED, MAX_STOP_LENGTH, MIN_SEED, REPETITION_PENALTY_RANGE)

from engine import tool_calls

from ..responses import rest as responses
from ..state import AppState, lockstep
from . import request_parsing as shapes

bp = Blueprint("openapi", __name__)

OPENAPI_VERSION = "3.1.0"
JSON = "application/json"
FINISH_REASONS = ["stop", "length", "abort"]
ROLES = list(shapes.ROLES)
MAX_TEMPERATURE = 100  # engine/sampling.py checks it inline


@bp.get("/openapi.json")
def openapi_document():
    return jsonify(build_document(lockstep()))


def build_document(state: AppState) -> dict:
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "lockstep", "version": _version(),
                 "description": "A small LLM server: REST generate calls, an OpenAI-compatible non-streaming subset, "
                                "and token streaming over the WebSocket at /ws. Validation errors are 400 with a "
                                "`code` of missing_field, invalid_value, unsupported_field or "
                                "context_length_exceeded, and `param` naming the field."},
        "paths": _paths(),
        "components": {"schemas": _schemas(state), "responses": _shared_responses(),
                       "securitySchemes": {"bearerAuth": {
                           "type": "http", "scheme": "bearer",
                           "description": "Required only when the server sets LOCKSTEP_API_KEY."}}},
        # Either no key (a server without LOCKSTEP_API_KEY) or the bearer key.
        "security": [{}, {"bearerAuth": []}],
    }


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lockstep")
    except PackageNotFoundError:
        return "0"


# -- paths --------------------------------------------------------------------------------------------------------

def _paths() -> dict:
    open_access = {"security": [{}]}
    return {
        "/basic_generate": {"post": _generate_operation(
            "basicGenerate", "One prompt, the whole answer", "BasicGenerateRequest", "BasicGenerateResponse")},
        "/generate": {"post": _generate_operation(
            "generate", "Several prompts batched; answers in the prompts' order", "GenerateRequest",
            "GenerateResponse")},
        "/v1/completions": {"post": _generate_operation(
            "createCompletion", "OpenAI completions (not streaming: stream over /ws)", "CompletionRequest",
            "Completion")},
        "/v1/chat/completions": {"post": _generate_operation(
            "createChatCompletion", "OpenAI chat completions (not streaming: stream over /ws)", "ChatRequest",
            "ChatCompletion")},
        "/tokenize": {"post": _operation("tokenize", "Token ids of a prompt, or of messages with the chat template",
                                         _ok("TokenizeResponse"), request="TokenizeRequest")},
        "/v1/models": {"get": _operation("listModels", "The served model", _ok("ModelList"))},
        "/v1/models/{model}": {"get": {
            **_operation("retrieveModel", "The model card, if `model` is the served model's id",
                         {**_ok("Model"), "404": _error_ref("NotFound")}),
            "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]}},
        "/health": {"get": {**_operation("health", "The process is up", _ok("Health")), **open_access}},
        "/ready": {"get": {**_operation("ready", "200 when this instance should get traffic", {
            **_ok("Ready"),
            "503": {"description": "Loading, restarting or draining", "headers": _retry_after(),
                    "content": {JSON: {"schema": _ref("NotReady")}}}}), **open_access}},
        "/metrics": {"get": {**_operation("metrics", "Prometheus metrics", {"200": {
            "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}),
            **open_access}},
        "/openapi.json": {"get": _operation("openapi", "This document", {"200": {
            "description": "OpenAPI 3.1", "content": {JSON: {"schema": {"type": "object"}}}}})},
        "/": {"get": {**_operation("chatPage", "The browser chat page", {"200": {
            "description": "HTML", "content": {"text/html": {"schema": {"type": "string"}}}}}), **open_access}},
        "/ws": {"get": _operation("websocket", _WS_DESCRIPTION, _upgrade_responses())},
        "/v1/responses": {
            "post": _generate_operation("createResponse", "OpenAI Responses (not streaming over HTTP: stream over "
                                        "the WebSocket at this path)", "ResponseRequest", "Response"),
            "get": _operation("responsesWebsocket", _RESPONSES_WS_DESCRIPTION, _upgrade_responses())},
        "/v1/responses/{response_id}": {
            "get": {**_operation("retrieveResponse", "A stored response",
                                 {**_ok("Response"), "404": _error_ref("NotFound")}), **_response_id()},
            "delete": {**_operation("deleteResponse", "Delete a stored response",
                                    {**_ok("ResponseDeleted"), "404": _error_ref("NotFound")}), **_response_id()}},
    }


def _response_id() -> dict:
    return {"parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]}


def _upgrade_responses() -> dict:
    return {"101": {"description": "Switching Protocols: the socket is open"},
            "400": _error_ref("BadRequest"), "426": _error_ref("UpgradeRequired")}


_WS_DESCRIPTION = (
    "WebSocket upgrade. Frames are JSON text with a `type`. Client: `{type: generate, id, prompt | messages, "
    "...sampling fields}` (the fields of /basic_generate; with messages also tools, tool_choice, "
    "parallel_tool_calls and chat_template_kwargs as chat completions takes them), `{type: cancel, id}`, "
    "`{type: auth, api_key}` (first frame, when the server has a key and the handshake had none). Server: `start`, "
    "`delta {id, text}` (with `index` and `logprobs` for n > 1 or logprobs; `reasoning` and `tool_calls` pieces, in "
    "OpenAI's chunk shape, where the answer has them), `done {id, finish_reason, usage, timing}` (with the finished "
    "`tool_calls`), `error {id, code, message, param}` (the socket stays usable). A request without an upgrade is "
    "400 `invalid_handshake`; more sockets than LOCKSTEP_MAX_SOCKETS, 503.")


_RESPONSES_WS_DESCRIPTION = (
    "OpenAI's Responses API in WebSocket mode (the SDK's client.responses.connect()); the key comes from the "
    "handshake's Authorization: Bearer. Client: `{type: response.create, ...the fields of POST /v1/responses, "
    "stream_id, generate}`. Server, per response, each with a sequence_number: response.created, "
    "response.in_progress, response.output_item.added, response.content_part.added, response.output_text.delta, "
    "response.output_text.done, response.content_part.done, response.output_item.done, response.completed | "
    "response.incomplete | response.failed; `error {status, error: {type, code, message, param}}` (the socket "
    "stays usable).")


# Request examples (schemathesis sends them too, so every response shape is checked at least once).
_EXAMPLES = {
    "BasicGenerateRequest": {"plain": {"prompt": "The capital of France is", "max_tokens": 8},
                             "samples": {"prompt": "Once upon a time", "max_tokens": 4, "n": 2, "temperature": 0.8,
                                         "seed": 1, "logprobs": 2}},
    "GenerateRequest": {"batch": {"prompts": ["1, 2, 3,", "Roses are red,"], "max_tokens": 6, "stop": ["\n"]}},
    "CompletionRequest": {"logprobs": {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 4,
                                       "logprobs": 2, "echo": True},
                          "token ids": {"prompt": [[504, 3153, 282], [19556, 314]], "max_tokens": 4}},
    "ChatRequest": {"chat": {"model": "smollm2", "max_completion_tokens": 8, "logprobs": True, "top_logprobs": 2,
                             "messages": [{"role": "developer", "content": "Answer briefly."},
                                          {"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]},
                    "json": {"messages": [{"role": "user", "content": "A JSON object with a name"}],
                             "max_tokens": 16, "response_format": {"type": "json_object"}}},
    "TokenizeRequest": {"prompt": {"prompt": "Hello world"}},
    "ResponseRequest": {"text": {"model": "smollm2", "input": "The capital of France is", "max_output_tokens": 8,
                                 "instructions": "Answer briefly.", "metadata": {"topic": "geography"}},
                        "items": {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]}],
                                  "max_output_tokens": 4, "store": False},
                        "json": {"input": "A JSON object with a name", "max_output_tokens": 16,
                                 "text": {"format": {"type": "json_object"}}}},
}


def _generate_operation(operation_id: str, summary: str, request: str, response: str) -> dict:
    return _operation(operation_id, summary, {**_ok(response), "413": _error_ref("TooLarge"),
                                              "429": _error_ref("Overloaded"), "504": _error_ref("DeadlineExceeded")},
                      request=request)


def _operation(operation_id: str, summary: str, responses: dict, request: str | None = None) -> dict:
    operation = {"operationId": operation_id, "summary": summary,
                 "responses": {**responses, "4XX": _error_ref("ClientError"), "5XX": _error_ref("ServerError")}}
    if request is not None:
        examples = {name: {"value": value} for name, value in _EXAMPLES.get(request, {}).items()}
        operation["requestBody"] = {"required": True,
                                    "content": {JSON: {"schema": _ref(request), "examples": examples}}}
        operation["responses"].setdefault("400", _error_ref("BadRequest"))
    return operation


def _ok(schema_name: str) -> dict:
    return {"200": {"description": "OK", "content": {JSON: {"schema": _ref(schema_name)}}}}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _error_ref(name: str) -> dict:
    return {"$ref": f"#/components/responses/{name}"}


def _retry_after() -> dict:
    return {"Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "string"}}}


def _shared_responses() -> dict:
    def error(description: str, headers: dict | None = None) -> dict:
        response = {"description": description, "content": {JSON: {"schema": _ref("Error")}}}
        if headers:
            response["headers"] = headers
        return response

    return {
        "BadRequest": error("A body that cannot be read (invalid_json, invalid_utf8, invalid_content_type, "
                            "invalid_body) or a field that is wrong (missing_field, invalid_value, "
                            "unsupported_field, context_length_exceeded; `param` names it)"),
        "NotFound": error("No such route, or no such model (model_not_found)"),
        "TooLarge": error("The body is over LOCKSTEP_MAX_BODY_BYTES (request_entity_too_large)"),
        "UpgradeRequired": error("Only WebSocket version 13"),
        "Overloaded": error("The waiting queue is full (overloaded)", _retry_after()),
        "DeadlineExceeded": error("The request ran past its deadline (deadline_exceeded)"),
        "ClientError": error("Other client errors: 401 a key is required, 403 origin not allowed, 404 not found, "
                             "405 method not allowed (with Allow), 421 a non-loopback Host on a loopback bind"),
        "ServerError": error("503 loading, restarting or draining (Retry-After), 500 worker or internal failure",
                             _retry_after()),
    }


# -- schemas ------------------------------------------------------------------------------------------------------

def _schemas(state: AppState) -> dict:
    sampling = _sampling_properties(state)
    no_echo = {name: value for name, value in sampling.items() if name != "echo"}  # /v1/completions only
    return {
        "Error": _error_schema(),
        "BasicGenerateRequest": _request({"prompt": _TEXT}, no_echo, required=["prompt"]),
        "GenerateRequest": _request({"prompts": {"type": "array", "items": _TEXT, "minItems": 1,
                                                 "maxItems": state.settings.max_prompts}},
                                    no_echo, required=["prompts"]),
        "CompletionRequest": _request({"prompt": _completion_prompt(state.settings.max_prompts),
                                       "max_tokens": _nullable(_max_tokens(echo=True))},
                                      sampling | _openai_common(), required=["prompt"]),
        "ChatRequest": _request({"messages": _ref("ChatMessages"), "max_completion_tokens": _nullable(_max_tokens()),
                                 **_tool_fields(), **_template_args()},
                                no_echo | _openai_common(), required=["messages"]),
        "ChatMessages": {"type": "array", "minItems": 1, "maxItems": shapes.MAX_MESSAGES,
                         "items": {"anyOf": [_message(), *_tool_messages()]}},
        "TokenizeRequest": {"type": "object", "additionalProperties": False,
                            "properties": {"prompt": _TEXT, "messages": _ref("Messages"), "model": _nullable(_STRING)},
                            "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]},
        "Messages": {"type": "array", "minItems": 1, "maxItems": shapes.MAX_MESSAGES, "items": _message()},
        "Usage": _object({"prompt_tokens": _COUNT, "completion_tokens": _COUNT, "total_tokens": _COUNT,
                          "prompt_tokens_details": _object({"cached_tokens": _COUNT})}),
        "Timing": _object({"queue_ms": _NUMBER, "ttft_ms": _nullable(_NUMBER), "e2e_ms": _NUMBER,
                           "tokens_per_s": _NUMBER}),
        "BasicGenerateResponse": _with_optional(
            _object({"generated_text": _STRING, "finish_reason": _FINISH, "usage": _ref("Usage"),
                     "timing": _ref("Timing")}),
            choices={**_array(_ref("SampleChoice")), "description": "With n > 1 or logprobs: every sample"}),
        "GenerateResponse": _with_optional(
            _object({"generated_texts": _array(_STRING), "finish_reasons": _array(_FINISH), "usage": _ref("Usage")}),
            choices={**_array(_array(_ref("SampleChoice"))), "description": "With n > 1 or logprobs: per prompt"}),
        "SampleChoice": _object({"index": _COUNT, "text": _STRING, "finish_reason": _FINISH,
                                 "logprobs": _nullable(_ref("ChatLogprobs"))}),
        "Completion": _openai_envelope("text_completion", _object({
            "index": _COUNT, "text": _STRING, "finish_reason": _FINISH,
            "logprobs": _nullable(_ref("CompletionLogprobs"))})),
        "ChatCompletion": _openai_envelope("chat.completion", _object({
            "index": _COUNT, "finish_reason": {"type": "string", "enum": [*FINISH_REASONS, "tool_calls"]},
            "logprobs": _nullable(_ref("ChatLogprobs")),
            "message": _with_optional(_object({"role": {"const": "assistant"}, "content": _nullable(_STRING)}),
                                      tool_calls=_array(_tool_call()), reasoning_content=_REASONING,
                                      reasoning=_REASONING)})),
        "ChatLogprobs": _object({"content": _array(_object({
            **_token_logprob()["properties"], "top_logprobs": _array(_token_logprob())}))}),
        "CompletionLogprobs": _object({
            "tokens": _array(_STRING), "token_logprobs": _array(_nullable(_NUMBER)),
            "top_logprobs": _array(_nullable({"type": "object", "additionalProperties": _NUMBER})),
            "text_offset": _array(_COUNT)}),
        "Model": _object({"id": _STRING, "object": {"const": "model"}, "created": _COUNT, "owned_by": _STRING}),
        "ModelList": _object({"object": {"const": "list"}, "data": _array(_ref("Model"))}),
        "TokenizeResponse": _object({"tokens": _array(_COUNT), "count": _COUNT, "max_model_len": _COUNT}),
        "Health": _object({"status": {"const": "ok"}}),
        "Ready": _object({"status": {"const": "ready"}, "model": _STRING}),
        "NotReady": _object({"status": {"const": "not_ready"}, "reason": _STRING}),
        **_responses_schemas(sampling),
    }


def _responses_schemas(sampling: dict) -> dict:
    """The Responses API: its request (lockstep's sampling fields beside OpenAI's), the response object."""
    own = {name: sampling[name] for name in responses.LOCKSTEP_SAMPLING | shapes.CACHE_SALT | {"temperature", "top_p"}}
    part = {"type": "object", "additionalProperties": False, "required": ["type", "text"],
            "properties": {"type": {"enum": list(responses.INPUT_PART_TYPES)}, "text": _STRING,
                           "annotations": {"type": "array", "maxItems": 0},
                           "logprobs": {"type": "array", "maxItems": 0}}}
    item = {"type": "object", "additionalProperties": False, "required": ["role", "content"],
            "properties": {"type": {"const": "message"}, "role": {"enum": ROLES},
                           "content": {"anyOf": [_STRING, {"type": "array", "minItems": 1, "items": part}]},
                           "id": {}, "status": {}, "phase": {}},
            "description": "A message item: developer is read as system, parts are joined by newlines"}
    call_item = {"type": "object", "additionalProperties": False, "required": ["type", "call_id", "name", "arguments"],
                 "properties": {"type": {"const": "function_call"}, "call_id": _CALL_ID, "name": _STRING,
                                "arguments": {"type": "string", "description": "a JSON object as text"},
                                "id": {}, "status": {}}, "description": "An earlier answer's call"}
    output_item = {"type": "object", "additionalProperties": False, "required": ["type", "call_id", "output"],
                   "properties": {"type": {"const": "function_call_output"}, "call_id": _CALL_ID, "output": _STRING,
                                  "id": {}, "status": {}},
                   "description": "A call's result: call_id names an earlier call"}
    message = _object({"id": _STRING, "type": {"const": "message"}, "role": {"const": "assistant"},
                       "status": {"enum": ["in_progress", "completed", "incomplete"]},
                       "content": _array(_object({"type": {"const": "output_text"}, "text": _STRING}))})
    function_call = _object({"id": _STRING, "type": {"const": "function_call"}, "call_id": _STRING, "name": _STRING,
                             "arguments": _STRING, "status": {"enum": ["completed", "incomplete"]}})
    reasoning = _object({"id": _STRING, "type": {"const": "reasoning"}, "summary": _array(_object({})),
                         "status": {"enum": ["completed"]},
                         "content": _array(_object({"type": {"const": "reasoning_text"}, "text": _STRING}))})
    chat_tools = _tool_fields()
    function = chat_tools["tools"]["anyOf"][0]["items"]["properties"]["function"]
    tool = {**function, "required": ["type", "name"],
            "properties": {"type": {"const": "function"}, **function["properties"]}}
    usage = _object({"input_tokens": _COUNT, "input_tokens_details": _object({"cached_tokens": _COUNT}),
                     "output_tokens": _COUNT, "total_tokens": _COUNT})
    return {
        "ResponseRequest": _request({
            "input": {"anyOf": [_TEXT, {"type": "array", "minItems": 1, "maxItems": shapes.MAX_MESSAGES,
                                        "items": {"anyOf": [item, call_item, output_item]}}]},
            "tools": _nullable({"type": "array", "maxItems": tool_calls.MAX_TOOLS, "items": tool,
                                "description": "function tools; names unique"}),
            "tool_choice": _nullable({"anyOf": [{"enum": list(tool_calls.CHOICES)}, {
                "type": "object", "required": ["type", "name"],
                "properties": {"type": {"const": "function"}, "name": _STRING}}]}),
            "parallel_tool_calls": _nullable({"type": "boolean"}),
            **_template_args(),
            "instructions": _nullable(_STRING), "max_output_tokens": _nullable(_max_tokens()),
            "text": _nullable({"type": "object", "additionalProperties": False, "properties": {
                "format": _nullable(_text_format()), "verbosity": {"type": "null"}}}),
            "previous_response_id": _nullable({"type": "string", "minLength": 1,
                                               "maxLength": responses.MAX_ID_LENGTH}),
            "store": _nullable({"type": "boolean", "description": "Default true: kept (bounded, oldest evicted)"}),
            "metadata": _metadata(),
            "user": _nullable({"type": "string", "maxLength": responses.MAX_USER_CHARS}),
            "model": _nullable(_STRING),
            "stream": {"enum": [False, None], "description": "Streaming is served over the WebSocket at /v1/responses"},
            **_not_implemented_fields(responses.NOT_IMPLEMENTED, responses.NOT_USED)}, own, required=["input"]),
        "Response": _object({
            "id": _STRING, "object": {"const": "response"}, "created_at": _COUNT, "model": _STRING,
            "status": {"enum": ["completed", "incomplete", "failed", "cancelled"]},
            "incomplete_details": _nullable(_object({"reason": _STRING})),
            "output": _array({"anyOf": [reasoning, message, function_call]}),
            "usage": _nullable(usage)}),
        "ResponseDeleted": _object({"id": _STRING, "object": {"const": "response.deleted"},
                                    "deleted": {"const": True}}),
    }


def _text_format() -> dict:
    """Responses' text.format: chat's response_format, with json_schema's fields beside `type`."""
    json_schema = _response_format()["oneOf"][1]["properties"]["json_schema"]
    return {"oneOf": [
        _response_format()["oneOf"][0],
        {**json_schema, "required": ["type", *json_schema["required"]],
         "properties": {"type": {"const": "json_schema"}, **json_schema["properties"]}},
    ]}


_STRING = {"type": "string"}
_TEXT = {"type": "string", "minLength": 1, "pattern": r"\S", "description": "Non-empty text"}
_NUMBER = {"type": "number"}
_COUNT = {"type": "integer", "minimum": 0}
_CALL_ID = {"type": "string", "minLength": 1, "maxLength": shapes.MAX_CALL_ID}
_REASONING = {"type": "string", "description": "The model's thinking (a <think> block), apart from content"}
_FINISH = {"type": "string", "enum": FINISH_REASONS}


def _nullable(schema: dict) -> dict:
    """OpenAI's optional fields may be sent as null, meaning absent."""
    return {"anyOf": [schema, {"type": "null"}]}


def _object(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties)}


def _with_optional(schema: dict, **optional: dict) -> dict:
    return {**schema, "properties": {**schema["properties"], **optional}}


def _token_logprob() -> dict:
    """One token's log-probability, as OpenAI's chat shape: `bytes` are exact where `token` may show U+FFFD."""
    return _object({"token": _STRING, "logprob": _NUMBER, "bytes": _array({"type": "integer", "minimum": 0,
                                                                           "maximum": 255})})


def _array(items: dict) -> dict:
    return {"type": "array", "items": items}


def _request(own: dict, shared: dict, required: list[str]) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": {**shared, **own}, "required": required}


def _error_schema() -> dict:
    return _object({"error": _object({"message": _STRING, "type": _STRING, "param": _nullable(_STRING),
                                      "code": _STRING})})


def _openai_envelope(obj: str, choice: dict) -> dict:
    return _object({"id": _STRING, "object": {"const": obj}, "created": _COUNT, "model": _STRING,
                    "choices": {"type": "array", "minItems": 1, "items": choice}, "usage": _ref("Usage")})


def _max_tokens(echo: bool = False) -> dict:
    if echo:
        return {"type": "integer", "minimum": 0, "description": "At most the model's context length; 0 only with echo "
                "(the prompt and its logprobs, nothing generated)"}
    return {"type": "integer", "minimum": 1, "description": "At most the model's context length"}


def _completion_prompt(max_prompts: int) -> dict:
    token_ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0},
                 "description": "Token ids of this model's vocabulary"}
    return {"oneOf": [
        _TEXT,
        {"type": "array", "minItems": 1, "maxItems": max_prompts, "items": _TEXT},
        token_ids,
        {"type": "array", "minItems": 1, "maxItems": max_prompts, "items": token_ids},
    ]}


def _message() -> dict:
    text_part = {"type": "object", "additionalProperties": False, "required": ["type", "text"],
                 "properties": {"type": {"const": "text"}, "text": _STRING}}
    content = {"anyOf": [_STRING, {"type": "array", "minItems": 1, "items": text_part}]}
    tool_fields = {name: {"anyOf": [{"type": "null"}, {"type": "array", "maxItems": 0}]}
                   for name in shapes.MESSAGE_TOOL_FIELDS}
    return {"type": "object", "additionalProperties": False, "required": ["role", "content"],
            "properties": {"role": {"enum": ROLES}, "content": content, "name": _STRING, **tool_fields},
            "description": "developer is read as system; text parts are joined by newlines; name is not used"}


def _tool_fields() -> dict:
    """Chat completions' tools (engine/tool_calls.py): function tools, the choice, parallel calls."""
    function = {"type": "object", "additionalProperties": False, "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "description": _nullable({"type": "string", "maxLength": tool_calls.MAX_DESCRIPTION_CHARS}),
        "parameters": _nullable({"type": "object", "description": "a JSON Schema (response_format's bounds)"}),
        "strict": _nullable({"type": "boolean"})}}
    tool = {"type": "object", "additionalProperties": False, "required": ["type", "function"],
            "properties": {"type": {"const": "function"}, "function": function}}
    named = {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                    "properties": {"name": _STRING}}}}
    return {"tools": _nullable({"type": "array", "maxItems": tool_calls.MAX_TOOLS, "items": tool,
                                "description": "function names unique"}),
            "tool_choice": _nullable({"anyOf": [{"enum": list(tool_calls.CHOICES)}, named],
                                      "description": "a named function must be in tools"}),
            "parallel_tool_calls": _nullable({"type": "boolean"})}


def _template_args() -> dict:
    """vLLM's chat_template_kwargs: of them, enable_thinking (app/rest/chat_request.py)."""
    return {"chat_template_kwargs": _nullable({
        "type": "object", "additionalProperties": False,
        "properties": {"enable_thinking": _nullable({"type": "boolean"})},
        "description": "enable_thinking false: a reasoning template's model answers without thinking"})}


def _tool_call() -> dict:
    return _object({"id": _STRING, "type": {"const": "function"},
                    "function": _object({"name": _STRING, "arguments": {"type": "string",
                                                                        "description": "a JSON object as text"}})})


def _tool_messages() -> list[dict]:
    """An assistant's calls (content null or text) and a tool's result, answering a call by its id."""
    content = _message()["properties"]["content"]
    calls = {"type": "object", "additionalProperties": False, "required": ["role", "tool_calls"], "properties": {
        "role": {"const": "assistant"}, "content": _nullable(content), "name": _STRING,
        "tool_calls": {"type": "array", "minItems": 1, "items": {**_tool_call(), "properties": {
            **_tool_call()["properties"], "id": _CALL_ID}}},
        **{name: {"type": "null"} for name in ("refusal", "audio", "function_call", "annotations")}}}
    result = {"type": "object", "additionalProperties": False, "required": ["role", "content", "tool_call_id"],
              "properties": {"role": {"const": "tool"}, "content": content, "tool_call_id": _CALL_ID,
                             "name": _STRING}, "description": "tool_call_id names an earlier call"}
    return [calls, result]


def _metadata() -> dict:
    return _nullable({"type": "object", "maxProperties": shapes.MAX_METADATA_PAIRS,
                      "propertyNames": {"maxLength": shapes.MAX_METADATA_KEY},
                      "additionalProperties": {"type": "string", "maxLength": shapes.MAX_METADATA_VALUE}})


def _openai_common() -> dict:
    return {"model": _nullable(_STRING), "user": _nullable(_STRING), "metadata": _metadata(),
            "store": {"enum": [False, None], "description": "This server keeps no completions"},
            "stream": {"enum": [False, None], "description": "Streaming is served over the WebSocket at /ws"},
            **_not_implemented_fields()}


def _not_implemented_fields(not_implemented: dict = shapes.NOT_IMPLEMENTED, not_used: dict = shapes.NOT_USED) -> dict:
    """OpenAI's fields this server does not implement: accepted only as null, or with a value that means
    "not used" (an empty tools list, tool_choice "none")."""
    return {name: {"enum": [*not_used.get(name, ()), None], "description": why}
            for name, why in not_implemented.items()}


def _sampling_properties(state: AppState) -> dict:
    stop_string = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH}
    max_stop = state.engine.config.max_stop_strings
    return {
        "max_tokens": _nullable(_max_tokens()),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": MAX_TEMPERATURE,
                                  "description": "0 = greedy"}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": 0, "description": "0 = off"}),
        "stop": _nullable({"anyOf": [stop_string, {"type": "array", "maxItems": max_stop, "items": stop_string}]}),
        "seed": _nullable({"type": "integer", "minimum": MIN_SEED, "maximum": MAX_SEED}),
        "ignore_eos": {"type": "boolean"},
        "timeout": _nullable({"type": "number", "exclusiveMinimum": 0,
                              "description": "Seconds; shortens the server's request deadline"}),
        "cache_salt": _nullable({"type": "string", "minLength": 1, "maxLength": MAX_CACHE_SALT_CHARS,
                                 "description": "Only requests with the same salt share cached prompt prefixes"}),
        **_sampling_engineer_fields(state.engine.config),
    }


def _sampling_engineer_fields(config) -> dict:
    """Penalties, logit bias, min_tokens, samples, logprobs, echo and JSON mode."""
    penalty = {"type": "number", "minimum": -MAX_PENALTY, "maximum": MAX_PENALTY}
    low, high = REPETITION_PENALTY_RANGE
    return {
        "presence_penalty": _nullable(penalty),
        "frequency_penalty": _nullable(penalty),
        "repetition_penalty": _nullable({"type": "number", "minimum": low, "maximum": high,
                                         "description": "1 = off (vLLM's semantics)"}),
        "logit_bias": _nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
                                 "propertyNames": {"pattern": "^(0|[1-9][0-9]*)$"},
                                 "additionalProperties": {"type": "number", "minimum": -MAX_LOGIT_BIAS,
                                                          "maximum": MAX_LOGIT_BIAS},
                                 "description": "Token id (of this model's vocabulary) -> bias"}),
        "min_tokens": _nullable({"type": "integer", "minimum": 0, "description": "At most max_tokens"}),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": config.sample_limit,
                        "description": "Samples (LOCKSTEP_MAX_SAMPLES); times the prompts, at most "
                                       f"{config.max_queue_per_client}"}),
        "best_of": _nullable({"type": "integer", "minimum": 1, "maximum": config.sample_limit,
                              "description": "At least n"}),
        "logprobs": _nullable({"anyOf": [{"type": "boolean"},
                                         {"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS}],
                               "description": "Chat: true/false (with top_logprobs); completions: the number "
                                              "of top logprobs"}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                                   "description": "With logprobs: true"}),
        "echo": {"type": "boolean", "description": "The prompt comes back before the answer; with logprobs, at most "
                 f"{config.max_echo_logprob_entries} logprob entries in all (prompts x n x tokens x (logprobs + 1))"},
        "response_format": _nullable(_response_format()),
    }


def _response_format() -> dict:
    name = {"type": "string", "minLength": 1, "maxLength": MAX_SCHEMA_NAME_LENGTH}
    json_schema = {"type": "object", "additionalProperties": False, "required": ["name", "schema"],
                   "properties": {"name": name, "description": _nullable(_STRING),
                                  "schema": {"type": "object"}, "strict": _nullable({"type": "boolean"})}}
    return {"oneOf": [
        {"type": "object", "additionalProperties": False, "required": ["type"],
         "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "additionalProperties": False, "required": ["type", "json_schema"],
         "properties": {"type": {"const": "json_schema"}, "json_schema": json_schema}},
    ]}

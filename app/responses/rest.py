"""OpenAI's Responses API over REST: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request becomes a `Turn`: the messages the chat template gets (instructions, the turns it continues, its new
input items), the sampling, and the fields the answer repeats. An engine output becomes OpenAI's response
object. app/responses/ws.py streams the same turns over the WebSocket (OpenAI's "WebSocket mode").
"""
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from flask import Blueprint, jsonify, request

from engine import FinishReason, InvalidRequest, RequestOutput, SamplingParams, check_encodable
from engine.answer_stream import AnswerShape
from engine.tool_calls import ToolRequest, parse_tool_request

from ..errors import FAILED_OUTPUT_MESSAGE, ApiError, invalid_value, missing_field, unsupported_field
from ..rest.api import run_one
from ..rest.chat_request import chat_parts, thinking_field
from ..rest.request_parsing import (CACHE_SALT, MAX_MESSAGES, OPENAI_COMMON, ROLE_AS, ROLES, TEMPLATE_ARGS, TOOL_FIELDS,
                                    ContentParts, RequestShape, check_call_ids, check_conversation, checked_call,
                                    checked_call_id, content_text, max_output_chars, metadata_field, read_json_body,
                                    sampling_fields, shown_name)
from ..state import lockstep
from .output import OutputItems
from .store import StoredResponse

logger = logging.getLogger(__name__)

bp = Blueprint("responses", __name__)

STREAM_HINT = ("streaming is served over the WebSocket: open ws://HOST/v1/responses and send response.create "
               "(the official SDK: client.responses.connect()); send \"stream\": false or omit it")
# lockstep's own sampling fields, as on its other endpoints (OpenAI's Responses API has none of them).
LOCKSTEP_SAMPLING = frozenset({"top_k", "seed", "stop", "ignore_eos", "timeout", "presence_penalty",
                               "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens"})
RESPONSE_FIELDS = OPENAI_COMMON | LOCKSTEP_SAMPLING | CACHE_SALT | TOOL_FIELDS | TEMPLATE_ARGS | {
    "input", "instructions", "temperature", "top_p", "text", "previous_response_id"}
NOT_IMPLEMENTED = {
    "max_tool_calls": "max_tool_calls is not supported (parallel_tool_calls: false allows one call)",
    "reasoning": "reasoning is not supported by this model",
    "background": "background responses are not supported (answers come in the call, or stream over the "
                  "WebSocket)",
    "include": "include is not supported: this server adds nothing to its responses",
    "truncation": "truncation is not supported (only \"disabled\"): a conversation past the context is refused",
    "conversation": "conversations are not supported: continue with previous_response_id",
    "prompt": "prompt templates are not supported",
    "top_logprobs": "top_logprobs are not supported on /v1/responses (use /v1/chat/completions)",
    "service_tier": "service_tier is not supported",
    "prompt_cache_key": "prompt_cache_key is not supported",
    "prompt_cache_retention": "prompt_cache_retention is not supported",
    "prompt_cache_options": "prompt_cache_options are not supported",
    "safety_identifier": "safety_identifier is not supported",
    "stream_options": "stream_options are not supported",
    "context_management": "context_management (compaction) is not supported",
    "moderation": "moderation is not supported",
    "image": "image options are not supported: this server answers text only",
    "access_programs": "access_programs are not supported",
    "background_options": "background responses are not supported",
}
NOT_USED = {"include": ([],), "truncation": ("disabled",), "background": (False,)}
RESPONSES = RequestShape("/v1/responses", RESPONSE_FIELDS, aliases={"max_output_tokens": "max_tokens"},
                         is_openai=True, not_implemented=NOT_IMPLEMENTED, not_used=NOT_USED, stream_hint=STREAM_HINT,
                         keeps_responses=True)

MAX_ID_LENGTH = 128
MAX_USER_CHARS = 256
MAX_CONVERSATION_MESSAGES = 4 * MAX_MESSAGES  # a continued conversation, all turns (the context bounds it too)
INPUT_PART_TYPES = ("input_text", "output_text")
# an output_text part as the SDK returns it carries annotations and logprobs: accepted when empty
INPUT_PARTS = ContentParts("input", INPUT_PART_TYPES, frozenset({"annotations", "logprobs"}))
ITEM_FIELDS = frozenset({"type", "role", "content", "id", "status", "phase"})
CALL_ITEM_FIELDS = {"function_call": frozenset({"type", "call_id", "name", "arguments", "id", "status"}),
                    "function_call_output": frozenset({"type", "call_id", "output", "id", "status"})}
STATUS_OF = {FinishReason.STOP: "completed", FinishReason.LENGTH: "incomplete", FinishReason.ABORT: "cancelled",
             FinishReason.ERROR: "failed"}


class PreviousResponseInProgress(ApiError):
    def __init__(self, response_id: str):
        super().__init__(400, f"previous response {shown_name(response_id)!r} is still in progress; continue it "
                              "once it has finished", "previous_response_in_progress", "previous_response_id")


class PreviousResponseNotFound(ApiError):
    def __init__(self, response_id: str):
        super().__init__(400, f"previous response {shown_name(response_id)!r} not found (never made, deleted, "
                              "evicted from the bounded store, or kept by another server process)",
                         "previous_response_not_found", "previous_response_id")


@dataclass(frozen=True)
class Turn:
    """One response to make: what the model reads, how it samples, what the answer repeats."""

    response_id: str
    messages: list[dict]  # instructions (as a system message), the previous turns, the new input
    history: tuple[dict, ...]  # the previous turns and the new input, without instructions: what a next turn continues
    sampling: SamplingParams
    fields: dict  # the request's fields that the response object repeats
    store: bool
    timeout_s: float | None
    created_at: int
    cache_salt: str | None = None
    shape: AnswerShape = AnswerShape()  # what to take apart in the answer: reasoning, calls (engine/answer_stream.py)
    template_tools: list[dict] | None = None  # what the chat template renders of the tools
    thinking: bool | None = None  # the template's enable_thinking (chat_template_kwargs)


# -- routes -------------------------------------------------------------------------------------------------------

@bp.post("/v1/responses")
def create_response():
    state = lockstep()
    body = read_json_body(RESPONSES, state.engine.max_model_len)
    turn = parse_turn(body, state.engine, state.responses.get)
    output = run_one(body, turn.sampling, messages=turn.messages, tools=turn.template_tools, thinking=turn.thinking)
    response = response_object(turn, output)
    remember(turn, response, [state.responses] if turn.store else [])
    return jsonify(response)


@bp.get("/v1/responses/<response_id>")
def retrieve_response(response_id: str):
    _refuse_query()
    return jsonify(_stored(response_id).response)


@bp.delete("/v1/responses/<response_id>")
def delete_response(response_id: str):
    _refuse_query()
    if not lockstep().responses.delete(response_id):
        raise _not_found(response_id)
    return jsonify(id=response_id, object="response.deleted", deleted=True)


def _stored(response_id: str) -> StoredResponse:
    stored = lockstep().responses.get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return stored


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"no stored response {shown_name(response_id)!r} (never stored, deleted, evicted, or "
                         "kept by another server process)", "response_not_found", "response_id")


def _refuse_query() -> None:
    """GET's `include`, `stream`, `starting_after`: nothing to include, and a stored response is not replayed."""
    for name in request.args:
        raise unsupported_field(shown_name(name), f"query parameter {shown_name(name)!r} is not supported")


# -- a request -> a turn ------------------------------------------------------------------------------------------

def parse_turn(body: dict, engine, find_previous: Callable[[str], StoredResponse | None],
               generate: bool = True) -> Turn:
    """A checked body (see RESPONSES) as a Turn; `find_previous` resolves previous_response_id. Without
    `generate` (the socket's warm-up) the input may be empty: the turn only prepares a conversation."""
    previous = _previous(body.get("previous_response_id"), find_previous)
    new_items = input_messages(body.get("input"), required=generate)
    history = (previous.history if previous else ()) + tuple(new_items)
    if len(history) > MAX_CONVERSATION_MESSAGES:
        raise invalid_value("input", f"the conversation would have {len(history)} messages; at most "
                                     f"{MAX_CONVERSATION_MESSAGES}")
    instructions = _instructions(body.get("instructions"))
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + list(history)
    if generate:
        check_conversation(list(history), "input")
        check_call_ids(list(history), "input")
    tools = _tool_request(body, engine)
    chat = chat_parts(messages, tools, _sampling(body, engine), thinking_field(body), engine)
    return Turn(f"resp_{uuid.uuid4().hex}", chat.messages, history, chat.sampling, _echoed_fields(body, tools),
                store=_store(body.get("store")), timeout_s=body.get("timeout"), created_at=int(time.time()),
                cache_salt=body.get("cache_salt"), shape=chat.shape, template_tools=chat.template_tools,
                thinking=chat.thinking)


def _tool_request(body: dict, engine) -> ToolRequest | None:
    """Responses' function tools ({type, name, description, parameters, strict}) and tool_choice ({type, name}),
    read as chat's (engine/tool_calls.py); built-in tools (web search, files, ...) are refused."""
    tools = body.get("tools")
    if isinstance(tools, list):
        for index, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise unsupported_field("tools", f"tools[{index}] is a {shown_name(str(kind))!r} tool; only "
                                                 "function tools are supported")
        tools = [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    return parse_tool_request({"tools": tools, "tool_choice": choice,
                               "parallel_tool_calls": body.get("parallel_tool_calls")}, max_output_chars(engine))


def _store(value) -> bool:
    if value is not None and not isinstance(value, bool):
        raise invalid_value("store", "store must be true or false")
    return value is not False


def _previous(response_id, find_previous) -> StoredResponse | None:
    if response_id is None:
        return None
    if not isinstance(response_id, str) or not response_id or len(response_id) > MAX_ID_LENGTH:
        raise invalid_value("previous_response_id", f"previous_response_id must be a response id (a string of at "
                                                    f"most {MAX_ID_LENGTH} characters)")
    previous = find_previous(response_id)
    if previous is None:
        raise PreviousResponseNotFound(response_id)
    if previous.response["status"] == "in_progress":
        raise PreviousResponseInProgress(response_id)
    return previous


def _instructions(value) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid_value("instructions", "instructions must be a string")
    check_encodable(value, "instructions")
    return value or None


def input_messages(value, required: bool = True) -> list[dict]:
    """`input` as {role, content} messages: a string is one user message; a list holds message items (roles
    user, system, developer, assistant; content a string or input_text / output_text parts)."""
    if value is None:
        if required:
            raise missing_field("input")
        return []
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or (required and not value):
        raise invalid_value("input", "input must be a string or a non-empty list of message items")
    if len(value) > MAX_MESSAGES:
        raise invalid_value("input", f"at most {MAX_MESSAGES} input items")
    messages = []
    for index, item in enumerate(value):
        if isinstance(item, dict) and item.get("type") == "reasoning":
            continue  # an earlier answer's thinking, sent back with it: templates leave it out of the history
        message = _input_message(item, f"input[{index}]")
        if message.get("tool_calls") and messages and messages[-1].get("tool_calls"):  # parallel calls: one turn
            messages[-1] = {**messages[-1], "tool_calls": messages[-1]["tool_calls"] + message["tool_calls"]}
        else:
            messages.append(message)
    return messages


def _input_message(item, where: str) -> dict:
    if not isinstance(item, dict):
        raise invalid_value("input", f"{where} must be a message item: {{role, content}}")
    if item.get("type") in CALL_ITEM_FIELDS:
        return _call_item(item, where)
    if item.get("type", "message") != "message":
        raise unsupported_field("input", f"{where} is a {shown_name(str(item.get('type')))!r} item; only message, "
                                         "function_call and function_call_output items are supported")
    if item.get("role") not in ROLES:
        raise invalid_value("input", f"{where}.role must be one of {', '.join(ROLES)}")
    extra = set(item) - ITEM_FIELDS
    if extra:
        raise unsupported_field("input", f"{where}: unknown item field {shown_name(sorted(extra)[0])!r}")
    content = content_text(item.get("content"), where, INPUT_PARTS)
    return {"role": ROLE_AS.get(item["role"], item["role"]), "content": content}


def _call_item(item: dict, where: str) -> dict:
    """A function_call item (an earlier answer's call) as an assistant's tool call; a function_call_output item
    as the tool message that answers it."""
    extra = set(item) - CALL_ITEM_FIELDS[item["type"]]
    if extra:
        raise unsupported_field("input", f"{where}: unknown item field {shown_name(sorted(extra)[0])!r}")
    if item["type"] == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            raise invalid_value("input", f"{where}.output must be a string")
        check_encodable(output, "input")
        return {"role": "tool", "content": output,
                "tool_call_id": checked_call_id(item.get("call_id"), f"{where}.call_id", "input")}
    call = checked_call((item.get("call_id"), f"{where}.call_id"), (item.get("name"), f"{where}.name"),
                        (item.get("arguments"), f"{where}.arguments"), "input")
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _sampling(body: dict, engine) -> SamplingParams:
    """The engine's sampling from the body; `text.format` is chat's `response_format` (JSON mode)."""
    response_format = _response_format(body.get("text"))
    try:
        return sampling_fields({**body, "response_format": response_format}, engine)
    except InvalidRequest as exc:
        if exc.param != "response_format":
            raise
        raise InvalidRequest(f"text.format (read as response_format): {exc}", "text") from None


def _response_format(text) -> dict | None:
    """Responses' text.format ({type, name, schema, strict}) as chat's response_format ({type, json_schema})."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise invalid_value("text", "text must be an object: {\"format\": {\"type\": ...}}")
    extra = set(text) - {"format", "verbosity"}
    if extra:
        raise unsupported_field("text", f"unknown text field {shown_name(sorted(extra)[0])!r}")
    if text.get("verbosity") is not None:
        raise unsupported_field("text", "text.verbosity is not supported")
    form = text.get("format")
    if not isinstance(form, dict) or form.get("type") != "json_schema":
        return form
    return {"type": "json_schema", "json_schema": {k: v for k, v in form.items() if k != "type"}}


def _echoed_fields(body: dict, tools: ToolRequest | None) -> dict:
    return {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_tokens"),
            "metadata": metadata_field(body.get("metadata")), "previous_response_id": body.get("previous_response_id"),
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto",  # OpenAI's default
            "tools": [{"type": "function", "name": tool.name, "description": tool.description or None,
                       "parameters": tool.parameters, "strict": None} for tool in tools.tools] if tools else [],
            "parallel_tool_calls": tools.is_parallel if tools else body.get("parallel_tool_calls") is not False,
            "user": _user(body.get("user"))}


def _user(value) -> str | None:
    if value is not None and len(value) > MAX_USER_CHARS:
        raise invalid_value("user", f"user must be at most {MAX_USER_CHARS} characters")
    return value


# -- an output -> OpenAI's response object ------------------------------------------------------------------------

def response_object(turn: Turn, output: RequestOutput | None, items: list[dict] | None = None) -> dict:
    """The response as OpenAI shapes it; `output` None: still in progress (or, for a warm-up, nothing made).
    `items`: its output items as a stream built them (otherwise built here from the output's text)."""
    fields, status = turn.fields, _status(output)
    return {
        "id": turn.response_id, "object": "response", "created_at": turn.created_at,
        "completed_at": int(time.time()) if status == "completed" else None,
        "status": status, "background": False, "error": _error(output),
        "incomplete_details": _incomplete_details(output), "instructions": fields["instructions"],
        "max_output_tokens": fields["max_output_tokens"], "metadata": fields["metadata"],
        "model": lockstep().model_name, "output": items if items is not None else output_items(turn, output),
        "parallel_tool_calls": fields["parallel_tool_calls"], "previous_response_id": fields["previous_response_id"],
        "reasoning": {"effort": None, "summary": None}, "store": turn.store,
        "temperature": turn.sampling.temperature, "text": fields["text"], "tool_choice": fields["tool_choice"],
        "tools": fields["tools"], "top_p": turn.sampling.top_p, "truncation": "disabled", "usage": usage_object(output),
        "user": fields["user"],
    }


def output_items(turn: Turn, output: RequestOutput | None) -> list[dict]:
    """A reasoning item (where the model thought), the assistant's message item (its text apart from any calls)
    and a function_call item per call (app/responses/output.py)."""
    if not has_output(output):
        return []
    items = OutputItems(turn.shape)
    items.feed(output.text)
    return items.finish(output)


def in_progress_object(turn: Turn) -> dict:
    return {**response_object(turn, None), "status": "in_progress", "completed_at": None, "usage": None}


def usage_object(output: RequestOutput | None) -> dict:
    prompt = output.usage.prompt_tokens if output else 0
    completion = output.usage.completion_tokens if output else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached_tokens(output),
                                                             "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def cached_tokens(output: RequestOutput | None) -> int:
    """Prompt tokens the engine did not compute again (its prefix cache): the one place this is read, 0 until
    the engine's usage reports it."""
    return getattr(output.usage, "cached_tokens", 0) if output else 0


def has_output(output: RequestOutput | None) -> bool:
    return output is not None and output.finish_reason is not FinishReason.ERROR


def _status(output: RequestOutput | None) -> str:
    if output is None:
        return "completed"  # a warm-up: nothing to make
    return STATUS_OF[output.finish_reason]


def _incomplete_details(output: RequestOutput | None) -> dict | None:
    if output is None or output.finish_reason is not FinishReason.LENGTH:
        return None
    return {"reason": "max_output_tokens"}


def _error(output: RequestOutput | None) -> dict | None:
    if output is None or output.finish_reason is not FinishReason.ERROR:
        return None
    return {"code": output.error_code or "server_error", "message": output.error or FAILED_OUTPUT_MESSAGE}


# -- conversation state -------------------------------------------------------------------------------------------

def remember(turn: Turn, response: dict, stores: list, completes: list = ()) -> None:
    """Keep the response (and the conversation it ends) where a next turn or a GET will look for it:
    `completes` hold it in progress since it started (see ResponseStore.complete)."""
    text = "".join(part["text"] for item in response["output"] if item["type"] == "message"
                   for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in response["output"] if item["type"] == "function_call"]
    answer = {"role": "assistant", "content": text or None, "tool_calls": calls} if calls else \
        {"role": "assistant", "content": text}
    history = turn.history + ((answer,) if response["output"] else ())
    stored = StoredResponse.of(response, history)
    for store in stores:
        if not store.put(stored):
            logger.info("response %s (%d bytes) is larger than a response store; not kept", turn.response_id,
                        stored.num_bytes)
    for store in completes:
        if not store.complete(stored):
            logger.info("response %s was deleted or evicted while it was made; not kept", turn.response_id)

"""A chat request's parts as the engine takes them, read alike by chat completions, /ws and the Responses API:
the messages and tools for the template, the sampling (with the tools' grammar), the thinking setting, and the
shape of its answer (what engine/answer_stream.py takes apart: reasoning and calls)."""
from dataclasses import dataclass

from engine import SamplingParams
from engine.answer_stream import AnswerShape
from engine.tool_calls import ToolRequest, constrained_sampling, parse_tool_request

from ..errors import invalid_value
from .request_parsing import max_output_chars, messages_field, sampling_fields

TEMPLATE_KWARGS = ("enable_thinking",)  # the chat template arguments a request may set


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict]
    template_tools: list[dict] | None  # what the chat template renders of the tools (a native template's)
    sampling: SamplingParams
    shape: AnswerShape
    thinking: bool | None  # the template's enable_thinking (None: its default)


def chat_request(body: dict, engine) -> ChatRequest:
    """Chat completions' and /ws's fields, checked (a 400 naming the field)."""
    tools = parse_tool_request(body, max_output_chars(engine))
    return chat_parts(messages_field(body, with_tools=True), tools, sampling_fields(body, engine),
                      thinking_field(body), engine)


def chat_parts(messages: list[dict], tools: ToolRequest | None, sampling: SamplingParams, thinking: bool | None,
               engine) -> ChatRequest:
    shape = engine.answer_shape(tools, thinking)
    messages, template_tools = shape.tool_format.prompt(messages, tools)
    sampling = constrained_sampling(sampling, tools, shape.tool_format, max_output_chars(engine),
                                    shape.reasoning_grammar)
    return ChatRequest(messages, template_tools, sampling, shape, thinking)


def thinking_field(body: dict) -> bool | None:
    """vLLM's `chat_template_kwargs`; of them, `enable_thinking` (false: a reasoning template's model answers
    without thinking, where its template allows it)."""
    value = body.get("chat_template_kwargs")
    if value is None:
        return None
    message = 'chat_template_kwargs takes {"enable_thinking": true or false} (no other template argument)'
    if not isinstance(value, dict) or set(value) - set(TEMPLATE_KWARGS):
        raise invalid_value("chat_template_kwargs", message)
    thinking = value.get("enable_thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise invalid_value("chat_template_kwargs", message)
    return thinking

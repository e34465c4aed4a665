"""An answer taken apart as it streams (engine/answer_stream.py): however the text is cut into deltas, the parts
are those of the whole answer; call markup never reaches the text; a call's name comes first and its argument
pieces add up to its arguments; reasoning is kept apart; and a forced call may follow a reasoning block."""
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llguidance import LLMatcher

from engine.answer_stream import (AnswerShape, AnswerSplitter, ArgumentsDelta, CallEnd, CallStart, ContentDelta,
                                  ReasoningDelta, opens_reasoning, template_has_reasoning)
from engine.response_format import _byte_tokenizer, grammar_of, parser_limits
from engine.tool_calls import GENERIC, HERMES, LLAMA3_JSON, parse_tool_request

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "get_time"}}]
AUTO = parse_tool_request({"tools": TOOLS})
WEATHER = {"city": "Pa\"}ris </tool_call> <tool_call>", "days": 3}  # markup and braces inside a string
ANSWERS = {
    "text and two calls": (GENERIC, False, "  Let me look.\n" + GENERIC.call_text("get_weather", WEATHER) + "\n"
                           + GENERIC.call_text("get_time", {}) + "\n"),
    "a call cut short": (GENERIC, False, "Hm " + GENERIC.call_text("get_time", {}) + '\n<tool_call>\n{"name": "get_'),
    "reasoning, then a call": (HERMES, True, "<think>\nThe user wants </thinking> weather.\n</think>\n\n"
                               + HERMES.call_text("get_weather", {"city": "Oslo", "days": 1})),
    "reasoning cut short": (HERMES, True, "<think>\nStill thinking <thi"),
    "no reasoning block": (HERMES, True, "Plain <b>answer</b> with a < sign"),
    "llama 3 call": (LLAMA3_JSON, False, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", '
                                         '"days": [1, {"x": 2}]}}'),
    "llama 3 text": (LLAMA3_JSON, False, 'Not a call: {"name": "get_time", "parameters": {}}'),
}


def run(shape: AnswerShape, pieces: list[str]) -> tuple[list, object]:
    splitter = AnswerSplitter(shape)
    parts = [part for piece in pieces for part in splitter.feed(piece)] + splitter.finish()
    return parts, splitter.result()


def cut(text: str, points: list[int]) -> list[str]:
    points = sorted({min(p, len(text)) for p in points})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


def summary(parts: list, result) -> tuple:
    """What a client assembles from the parts, without the call ids (new for every run)."""
    content = "".join(p.text for p in parts if isinstance(p, ContentDelta))
    reasoning = "".join(p.text for p in parts if isinstance(p, ReasoningDelta))
    names = [p.name for p in parts if isinstance(p, CallStart)]
    arguments = {}
    for part in parts:
        if isinstance(part, ArgumentsDelta):
            arguments[part.index] = arguments.get(part.index, "") + part.text
    ended = [(p.call.name, p.call.arguments) for p in parts if isinstance(p, CallEnd)]
    return content, reasoning, names, arguments, ended, result.content, result.reasoning, \
        [(c.name, c.arguments) for c in result.calls]


@pytest.mark.parametrize("name", ANSWERS)
@settings(max_examples=60, deadline=None)
@given(points=st.lists(st.integers(min_value=0, max_value=400), max_size=30))
def test_any_cut_into_deltas_gives_the_parts_of_the_whole_answer(name, points):
    tool_format, has_reasoning, text = ANSWERS[name]
    shape = AnswerShape(AUTO, tool_format, has_reasoning)
    assert summary(*run(shape, cut(text, points))) == summary(*run(shape, [text]))


def test_calls_are_taken_out_whole_and_their_pieces_add_up():
    parts, answer = run(AnswerShape(AUTO, GENERIC), list(ANSWERS["text and two calls"][2]))  # a character a delta
    assert answer.content == "Let me look." and "".join(p.text for p in parts if isinstance(p, ContentDelta)) == \
        "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in answer.calls] == [("get_weather", WEATHER), ("get_time", {})]
    starts = [i for i, p in enumerate(parts) if isinstance(p, CallStart)]
    first_arguments = next(i for i, p in enumerate(parts) if isinstance(p, ArgumentsDelta))
    assert starts[0] < first_arguments  # the name before any argument
    for call_index, call in enumerate(answer.calls):
        pieces = "".join(p.text for p in parts if isinstance(p, ArgumentsDelta) and p.index == call_index)
        assert pieces == call.arguments
        assert [p.id for p in parts if isinstance(p, CallStart) and p.index == call_index] == [call.id]
    assert len({c.id for c in answer.calls}) == 2


def test_a_call_cut_short_is_dropped_and_its_markup_never_becomes_text():
    _, answer = run(AnswerShape(AUTO, GENERIC), [ANSWERS["a call cut short"][2]])
    assert answer.content == "Hm" and [c.name for c in answer.calls] == ["get_time"]


def test_reasoning_is_kept_apart_and_may_open_in_the_prompt():
    _, answer = run(AnswerShape(AUTO, HERMES, has_reasoning=True), [ANSWERS["reasoning, then a call"][2]])
    assert answer.reasoning == "The user wants </thinking> weather." and answer.content is None
    assert answer.calls[0].name == "get_weather"
    _, opened = run(AnswerShape(None, HERMES, has_reasoning=True, in_reasoning=True), ["I think.</think>\n\nHi."])
    assert (opened.reasoning, opened.content) == ("I think.", "Hi.")
    _, cut_short = run(AnswerShape(None, HERMES, has_reasoning=True), [ANSWERS["reasoning cut short"][2]])
    assert (cut_short.reasoning, cut_short.content) == ("Still thinking <thi", "")
    _, plain = run(AnswerShape(None, HERMES, has_reasoning=True), [ANSWERS["no reasoning block"][2]])
    assert (plain.reasoning, plain.content) == (None, ANSWERS["no reasoning block"][2])


def test_a_template_with_a_think_block_is_told_apart_and_where_its_prompt_opens_it():
    template = "{% if enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"

    def render(messages, extra):
        return "<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if extra.get("enable_thinking") is False
                                           else "<think>\n")
    assert template_has_reasoning(template) and not template_has_reasoning("{{ messages }}")
    assert opens_reasoning(render, None) and not opens_reasoning(render, False)


def accepts(grammar: str, text: str) -> bool:
    matcher = LLMatcher(_byte_tokenizer(), grammar_of("lark", grammar), log_level=0, limits=parser_limits())
    return matcher.consume_tokens(list(text.encode())) and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize("tool_format", [GENERIC, LLAMA3_JSON], ids=["hermes", "llama3-json"])
def test_a_forced_call_may_follow_the_models_thinking_and_nothing_else(tool_format):
    required = parse_tool_request({"tools": TOOLS, "tool_choice": "required"})
    call = tool_format.call_text("get_time", {})
    optional, opened = tool_format.grammar(required, "optional"), tool_format.grammar(required, "open")
    assert accepts(optional, call) and accepts(optional, "<think>\nhm\n</think>\n\n" + call)
    assert accepts(opened, "hm\n</think>\n\n" + call) and not accepts(opened, call)
    for grammar in (optional, opened, tool_format.grammar(required)):
        assert not accepts(grammar, "text " + call)
        assert not accepts(grammar, "<think>a</think>b</think>" + call)
    assert not accepts(tool_format.grammar(required), "<think>\nhm\n</think>\n\n" + call)

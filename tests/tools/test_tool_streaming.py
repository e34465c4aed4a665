"""Tool calls and reasoning as they stream: /ws deltas carry a call as it forms, the Responses socket sends
OpenAI's function-call events (the official SDK's `responses.connect()`), an openai-agents agent runs a function
tool end to end over it, and a template with a `<think>` block gets its reasoning kept apart everywhere."""
import asyncio
import json
import shutil

import jsonschema
import pytest
from playwright.sync_api import expect

from lockstep_client import Client

from ..client import WsClient, http
from ..conftest import sdk, start_live_server
from ..page.test_page import browser, last_answer, open_page, send, set_settings, wait_done  # noqa: F401
from ..torch_jobs import run_job
from .test_tool_calls import ASK, RESPONSES_TOOLS, TOOLS, WEATHER_PARAMETERS

GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(float32_servers):
    return float32_servers("hf")


def assembled_calls(frames: list[dict]) -> list[dict]:
    """A client's reassembly of streamed calls: the first piece of each has its id and name, then arguments."""
    calls: dict[int, dict] = {}
    for frame in frames:
        for piece in frame.get("tool_calls", ()) if frame["type"] == "delta" else ():
            call = calls.setdefault(piece["index"], {"id": None, "name": None, "arguments": ""})
            call["id"] = call["id"] or piece.get("id")
            call["name"] = call["name"] or piece.get("function", {}).get("name")
            call["arguments"] += piece["function"]["arguments"]
    return [calls[index] for index in sorted(calls)]


def test_ws_streams_a_forced_call_as_it_forms_and_says_what_rest_says(server):
    ws = WsClient(server.ws_url)
    try:
        ws.generate("c", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200, **GREEDY)
        result = ws.collect(["c"])["c"]
    finally:
        ws.close()
    deltas = [e for e in result["events"] if e["type"] == "delta"]
    done = result["final"]
    assert done["type"] == "done" and done["finish_reason"] == "tool_calls"
    calls = assembled_calls(deltas)
    assert len([d for d in deltas if d.get("tool_calls")]) > len(calls)  # arguments came in pieces
    assert calls == [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                     for c in done["tool_calls"]]
    for call in calls:
        if call["name"] == "get_weather":
            jsonschema.validate(json.loads(call["arguments"]), WEATHER_PARAMETERS)
        else:
            assert call["name"] == "get_time" and json.loads(call["arguments"]) == {}
    assert "<tool_call" not in "".join(d["text"] for d in deltas)
    # The same greedy request over REST makes the same calls.
    status, _, rest = http("POST", server.url + "/v1/chat/completions", {
        "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, **GREEDY})
    assert status == 200
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in rest["choices"][0]["message"][
        "tool_calls"]] == [(c["name"], c["arguments"]) for c in calls]


def test_ws_tools_go_with_messages_and_bad_tools_leave_the_socket_usable(server):
    ws = WsClient(server.ws_url)
    try:
        ws.generate("p", prompt="Hi", tools=TOOLS, max_tokens=3)
        ws.generate("t", messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "fly"}})
        ws.generate("ok", messages=ASK, max_tokens=3)
        results = ws.collect(["p", "t", "ok"])
    finally:
        ws.close()
    assert results["p"]["final"]["param"] == "tools"
    assert results["t"]["final"]["param"] == "tool_choice"
    assert results["ok"]["final"]["type"] == "done" and results["ok"]["text"]


def test_the_responses_socket_streams_function_call_events_and_the_turn_continues(server):
    with sdk(server).responses.connect() as connection:
        connection.response.create(model="smollm2", input=ASK[0]["content"], tools=RESPONSES_TOOLS,
                                   tool_choice={"type": "function", "name": "get_weather"},
                                   parallel_tool_calls=False, max_output_tokens=200, **GREEDY)
        events = []
        while not events or events[-1].type not in ("response.completed", "response.incomplete", "error"):
            events.append(connection.recv())
        response = events[-1].response
        [item] = [e.item for e in events if e.type == "response.output_item.added"]
        assert item.type == "function_call" and item.name == "get_weather" and item.arguments == ""
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
        [finished] = [e.item for e in events if e.type == "response.output_item.done"]
        assert len(pieces) > 1 and "".join(pieces) == done.arguments == finished.arguments
        jsonschema.validate(json.loads(done.arguments), WEATHER_PARAMETERS)
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type == "response.completed" and finished.status == "completed"
        assert [(o.type, o.call_id, o.arguments) for o in response.output] == [
            ("function_call", finished.call_id, done.arguments)]
        assert not any(e.type == "response.output_text.delta" for e in events)
        # the call's result goes back on the same socket, and the conversation goes on
        connection.response.create(model="smollm2", previous_response_id=response.id, tools=RESPONSES_TOOLS,
                                   max_output_tokens=16, **GREEDY,
                                   input=[{"type": "function_call_output", "call_id": finished.call_id,
                                           "output": "Sunny, 24 C"}])
        follow_up = []
        while not follow_up or follow_up[-1].type not in ("response.completed", "response.incomplete", "error"):
            follow_up.append(connection.recv())
        assert follow_up[-1].type in ("response.completed", "response.incomplete") and follow_up[-1].response.output


def test_a_call_cut_short_ends_as_far_as_it_streamed(server):
    """max_output_tokens ends a forced call midway: its item is incomplete, with the arguments its deltas carried."""
    with sdk(server).responses.connect() as connection:
        connection.response.create(model="smollm2", input=ASK[0]["content"], tools=RESPONSES_TOOLS,
                                   tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=20,
                                   **GREEDY)
        events = []
        while not events or events[-1].type not in ("response.completed", "response.incomplete", "error"):
            events.append(connection.recv())
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    [item] = [e.item for e in events if e.type == "response.output_item.done"]
    assert events[-1].type == "response.incomplete" and item.status == "incomplete"
    assert pieces and done.arguments == item.arguments == pieces
    assert [o.arguments for o in events[-1].response.output] == [pieces]


def test_an_agent_runs_a_function_tool_over_the_responses_socket(server):
    import agents
    import openai
    from agents.models import _openai_shared
    from agents.tracing import set_tracing_disabled

    asked = []

    @agents.function_tool
    def get_weather(city: str, days: int) -> str:
        """The weather forecast for a city."""
        asked.append((city, days))
        return f"Sunny in {city} for {days} days"

    saved = (_openai_shared.get_default_openai_client(), _openai_shared.get_default_openai_responses_transport())
    agents.set_default_openai_client(openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused",
                                                        max_retries=0, timeout=120), use_for_tracing=False)
    agents.set_default_openai_api("responses")
    agents.set_default_openai_responses_transport("websocket")
    set_tracing_disabled(True)
    try:
        agent = agents.Agent(name="Weather", instructions="Use the tool.", model="smollm2", tools=[get_weather],
                             tool_use_behavior="stop_on_first_tool",
                             model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                                 parallel_tool_calls=False, max_tokens=200))
        result = asyncio.run(agents.Runner.run(agent, ASK[0]["content"], max_turns=2))
    finally:
        _openai_shared.set_default_openai_client(saved[0])
        agents.set_default_openai_responses_transport(saved[1])
        set_tracing_disabled(False)
    assert len(asked) == 1 and isinstance(asked[0][0], str) and isinstance(asked[0][1], int)
    assert result.final_output == f"Sunny in {asked[0][0]} for {asked[0][1]} days"


# -- a template with a reasoning block ---------------------------------------------------------------------------

# A Qwen3-style template (ChatML, Hermes calls) whose generation prompt opens the `<think>` block, or writes an
# empty one when enable_thinking is false.
THINKING_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
For each call return <tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content or '' }}{% for call in message.tool_calls or [] %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory, tiny_model_dir):
    model_dir = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))
    (model_dir / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    server = start_live_server(str(model_dir), dtype="float32", threads=0)
    yield server
    server.stop()


def test_reasoning_is_kept_apart_in_chat_ws_and_responses_and_can_be_turned_off(thinking_server):
    url = thinking_server.url
    _, _, card = http("GET", url + "/v1/models")
    assert card["data"][0]["reasoning"] is True and card["data"][0]["tool_call_format"] == "hermes"
    assert card["data"][0]["max_tools"] == 128
    body = {"messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 24, **GREEDY}
    status, _, chat = http("POST", url + "/v1/chat/completions", body)
    message = chat["choices"][0]["message"]
    assert status == 200 and message["reasoning_content"] and message["reasoning"] == message["reasoning_content"]
    assert "<think>" not in message["content"] and "</think>" not in message["content"]
    ws = WsClient(thinking_server.ws_url)
    try:
        ws.generate("r", **body)
        frames = ws.collect(["r"])["r"]["events"]
    finally:
        ws.close()
    assert "".join(f.get("reasoning", "") for f in frames) == message["reasoning_content"]
    assert "".join(f.get("text", "") for f in frames) == message["content"]
    status, _, response = http("POST", url + "/v1/responses", {"input": body["messages"][0]["content"],
                                                               "max_output_tokens": 24, **GREEDY})
    assert status == 200 and response["output"][0]["type"] == "reasoning"
    assert response["output"][0]["content"][0]["text"] == message["reasoning_content"]
    assert Client(url).generate(messages=body["messages"], max_tokens=24, **GREEDY).reasoning == \
        message["reasoning_content"]  # lockstep_client.py reads it too
    status, _, plain = http("POST", url + "/v1/chat/completions",
                            {**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and "reasoning_content" not in plain["choices"][0]["message"]
    assert plain["choices"][0]["message"]["content"]
    status, _, bad = http("POST", url + "/v1/chat/completions", {**body, "chat_template_kwargs": {"x": 1}})
    assert status == 400 and bad["error"]["param"] == "chat_template_kwargs"


def test_a_native_template_renders_the_tools_and_its_forced_call_streams(thinking_server):
    """The template renders the tools itself (Hermes, as Qwen's do); with thinking off, a forced call's grammar
    starts at once, and REST and /ws make the same call."""
    now = [{"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]
    body = {"messages": ASK, "tools": now, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 40,
            "chat_template_kwargs": {"enable_thinking": False}, **GREEDY}
    status, _, chat = http("POST", thinking_server.url + "/v1/chat/completions", body)
    assert status == 200 and chat["choices"][0]["finish_reason"] == "tool_calls", chat
    message = chat["choices"][0]["message"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("now", "{}")]
    assert message["content"] is None and "reasoning_content" not in message
    ws = WsClient(thinking_server.ws_url)
    try:
        ws.generate("n", **body)
        result = ws.collect(["n"])["n"]
    finally:
        ws.close()
    assert result["final"]["finish_reason"] == "tool_calls" and result["text"] == ""
    completion = Client(thinking_server.url).generate(**body)  # lockstep_client.py: the calls, no text
    assert completion.text is None and [c["function"]["name"] for c in completion.tool_calls] == ["now"]
    assert [(c["name"], c["arguments"]) for c in assembled_calls(result["events"])] == [("now", "{}")]


@pytest.fixture(scope="module")
def qwen3_file_server(tmp_path_factory, smol_model_dir):
    """A Qwen3 GGUF file (random weights) whose own chat template is the Qwen3-style one above."""
    target = tmp_path_factory.mktemp("qwen3-gguf")
    files = run_job("build_gguf_models", target=str(target), families=["qwen3"], tokenizer_dir=smol_model_dir,
                    chat_template=THINKING_TEMPLATE)
    server = start_live_server(files["qwen3"]["gguf"], cache_dir=str(target / "cache"), threads=0)
    yield server
    server.stop()


def test_a_qwen_family_file_calls_and_thinks_in_its_own_templates_format(qwen3_file_server):
    url = qwen3_file_server.url
    _, _, card = http("GET", url + "/v1/models")
    model = card["data"][0]
    assert model["architecture"] == "qwen3" and model["tool_call_format"] == "hermes" and model["reasoning"]
    now = [{"type": "function", "function": {"name": "now", "parameters": {
        "type": "object", "properties": {}, "additionalProperties": False}}}]
    status, _, chat = http("POST", url + "/v1/chat/completions", {
        "messages": ASK, "tools": now, "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 40,
        "chat_template_kwargs": {"enable_thinking": False}, **GREEDY})
    assert status == 200 and chat["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["function"]["name"] for c in chat["choices"][0]["message"]["tool_calls"]] == ["now"]
    status, _, thought = http("POST", url + "/v1/chat/completions", {"messages": ASK, "max_tokens": 16, **GREEDY})
    assert status == 200 and thought["choices"][0]["message"]["reasoning_content"]


# -- the page ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smol_server(thinking_server):
    """The page tests' server (tests/page/test_page.py's open_page): here, the one with a reasoning template."""
    return thinking_server


def test_the_page_shows_the_thinking_folded_above_the_answer(open_page):
    page = open_page()
    set_settings(page, temperature=0, max_tokens=24)
    send(page, "Why is the sky blue?")
    answer = last_answer(page)
    wait_done(answer)
    box = answer.locator("details.reasoning")
    expect(box).to_have_count(1)
    assert not box.evaluate("details => details.open")  # folded until the reader opens it
    thought = box.locator(".reasoning-text").text_content()
    assert thought.strip() and "<think>" not in answer.locator(".body").text_content()
    page.reload()  # the stored conversation keeps the thinking, folded as before
    expect(last_answer(page).locator("details.reasoning .reasoning-text")).to_have_text(thought)

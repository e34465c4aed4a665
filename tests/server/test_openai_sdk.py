"""The OpenAI-compatible surface through the official `openai` SDK, as a new user would call it, against the live
server: current message shapes, token-id prompts, models.retrieve, max_completion_tokens, every validation error a
400 (`BadRequestError`) with one code vocabulary, unimplemented fields refused by name, JSON 404/405 everywhere."""
import openai
import pytest

from ..client import WsClient, http
from ..conftest import sdk

VALIDATION_CODES = {"missing_field", "invalid_value", "unsupported_field", "context_length_exceeded"}
GREEDY = {"temperature": 0}
NO_EOS = {"extra_body": {"ignore_eos": True}}
QUESTION = "What is the capital of France?"


# -- on both backends -------------------------------------------------------------------------------------------

def test_models_list_and_retrieve(sdk_server):
    client = sdk(sdk_server)
    listed = client.models.list().data
    assert len(listed) == 1
    model = client.models.retrieve(listed[0].id)
    assert (model.id, model.object, model.owned_by) == (listed[0].id, "model", "lockstep")
    with pytest.raises(openai.NotFoundError) as refused:
        client.models.retrieve("gpt-4o")
    assert refused.value.code == "model_not_found"


def test_chat_takes_developer_role_text_parts_names_and_max_completion_tokens(sdk_server):
    client = sdk(sdk_server)
    plain = client.chat.completions.create(
        model="smollm2", max_tokens=30, **GREEDY,
        messages=[{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": QUESTION}])
    modern = client.chat.completions.create(
        model="smollm2", max_completion_tokens=30, **GREEDY,
        messages=[{"role": "developer", "content": [{"type": "text", "text": "You are a helpful assistant."}]},
                  {"role": "user", "name": "ada", "content": [{"type": "text", "text": QUESTION}]}])
    # developer is the system role; one text part is that text; a name changes nothing
    assert modern.choices[0].message.content == plain.choices[0].message.content
    assert "Paris" in modern.choices[0].message.content
    capped = client.chat.completions.create(model="smollm2", max_completion_tokens=5, **NO_EOS,
                                            messages=[{"role": "user", "content": "Tell me a long story."}])
    assert capped.usage.completion_tokens == 5 and capped.choices[0].finish_reason == "length"


def test_completions_take_token_id_prompts(sdk_server):
    client = sdk(sdk_server)
    text_prompts = ["1, 2, 3, 4,", "Monday, Tuesday, Wednesday,"]
    token_ids = [http("POST", sdk_server.url + "/tokenize", {"prompt": p})[2]["tokens"] for p in text_prompts]
    by_text = client.completions.create(model="smollm2", prompt=text_prompts, max_tokens=6, **GREEDY)
    by_ids = client.completions.create(model="smollm2", prompt=token_ids, max_tokens=6, **GREEDY)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert "Thursday" in by_ids.choices[1].text
    one = client.completions.create(model="smollm2", prompt=token_ids[0], max_tokens=6, **GREEDY)
    assert one.choices[0].text == by_text.choices[0].text and one.usage.prompt_tokens == len(token_ids[0])
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="smollm2", prompt=[1, 2, 10 ** 9], max_tokens=2)
    assert (refused.value.code, refused.value.param) == ("invalid_value", "prompt")


def test_the_python_client_streams_what_the_sdk_gets(sdk_server):
    from lockstep_client import Client

    messages = [{"role": "developer", "content": "Answer briefly."},
                {"role": "user", "content": [{"type": "text", "text": QUESTION}]}]
    reply = sdk(sdk_server).chat.completions.create(model="smollm2", messages=messages, max_tokens=20, **GREEDY)
    pieces = list(Client(sdk_server.url).stream(messages=messages, max_tokens=20, temperature=0))
    assert len(pieces) > 1 and "".join(pieces) == reply.choices[0].message.content


# -- the validation surface (backend-independent: the transformers backend) ------------------------------------

@pytest.fixture(scope="module")
def hf_server(smol_server):
    return smol_server


CHAT = {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
def test_a_system_message_alone_is_a_prompt_and_a_wrong_role_is_named(sdk_server):
    client = sdk(sdk_server)
    instruction = "Write one sentence about the sea."
    for messages in ([{"role": "system", "content": instruction}], [{"role": "developer", "content": instruction}],
                     [{"role": "system", "content": instruction}, {"role": "user", "content": " "}]):
        answer = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=8, **GREEDY)
        assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="smollm2", messages=[{"role": "USER", "content": "Hi"}], max_tokens=2)
    assert "'USER' is not one of" in refused.value.message


COMPLETION = {"model": "smollm2", "prompt": "Hi", "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("call, fields, code, param", [
    ("chat", {"temperature": -1}, "invalid_value", "temperature"),
    ("chat", {"temperature": "hot"}, "invalid_value", "temperature"),
    ("chat", {"messages": []}, "invalid_value", "messages"),
    ("chat", {"messages": [{"role": "wizard", "content": "x"}]}, "invalid_value", "messages"),
    ("chat", {"messages": [{"role": "system", "content": " "}, {"role": "user", "content": ""}]}, "invalid_value",
     "messages"),
    ("chat", {"tools": [TOOL, TOOL]}, "invalid_value", "tools"),  # the same name twice
    ("chat", {"tool_choice": "required"}, "invalid_value", "tool_choice"),  # no tools to call
    ("chat", {"functions": [TOOL["function"]]}, "unsupported_field", "functions"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "unsupported_field", "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "unsupported_field", "modalities"),
    ("chat", {"stream_options": {"include_usage": True}}, "unsupported_field", "stream_options"),
    ("chat", {"store": True}, "unsupported_field", "store"),
    ("chat", {"store": 0.0}, "unsupported_field", "store"),  # equal to False in Python, not JSON's false
    ("completions", {"stream": 0}, "invalid_value", "stream"),
    ("chat", {"max_tokens": 4, "max_completion_tokens": 5}, "invalid_value", "max_completion_tokens"),
    ("chat", {"max_completion_tokens": 0}, "invalid_value", "max_completion_tokens"),
    ("chat", {"max_tokens": None, "max_completion_tokens": 10 ** 9}, "invalid_value", "max_completion_tokens"),
    ("chat", {"extra_body": {"max_completion_tokens": 2.5}}, "invalid_value", "max_completion_tokens"),
    ("chat", {"extra_body": {"frobnicate": 1}}, "unsupported_field", "frobnicate"),
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, "unsupported_field", "messages"),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]},
     "invalid_value", "messages"),
    ("chat", {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "invalid_value", "messages"),  # arguments must be an object
    ("chat", {"messages": [{"role": "tool", "tool_call_id": "c1", "content": "18C"}]}, "invalid_value",
     "messages"),  # answers no call
    ("completions", {"suffix": " the end."}, "unsupported_field", "suffix"),
    ("completions", {"prompt": [1, "two"]}, "invalid_value", "prompt"),
    ("completions", {"prompt": [[1, 2], []]}, "invalid_value", "prompt"),
    ("completions", {"prompt": [-1]}, "invalid_value", "prompt"),
    ("completions", {"prompt": "word " * 9000}, "context_length_exceeded", "prompt"),
    ("completions", {"extra_body": {"max_completion_tokens": 5}}, "unsupported_field", "max_completion_tokens"),
])
def test_bad_requests_are_bad_request_errors_naming_the_field(hf_server, call, fields, code, param):
    client = sdk(hf_server)
    create = client.chat.completions.create if call == "chat" else client.completions.create
    with pytest.raises(openai.BadRequestError) as refused:
        create(**{**(CHAT if call == "chat" else COMPLETION), **fields})
    error = refused.value
    assert (error.status_code, error.code, error.param) == (400, code, param), error.message
    assert error.code in VALIDATION_CODES and error.body["message"]


@pytest.mark.parametrize("raw, code, param", [
    (b'"temperature": NaN', "invalid_value", "temperature"),
    (b'"max_completion_tokens": 1e-300', "invalid_value", "max_completion_tokens"),
    (b'"\\ud800' + b"x" * 500 + b'": 1', "unsupported_field", "?" + "x" * 63),  # a lone surrogate, 501 chars
    (b'"prompt_logprobs": 1', "unsupported_field", "prompt_logprobs"),
    (b'"messages": [{"role": "user", "content": [' + b'{"type": "text", "text": "a"},' * 20000 +
     b'{"type": "input_audio", "input_audio": {}}]}]', "unsupported_field", "messages"),
])
def test_hostile_values_the_sdk_cannot_send(hf_server, raw, code, param):
    body = b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, ' + raw + b"}"
    if raw.startswith(b'"messages"'):
        body = b'{"max_tokens": 2, ' + raw + b"}"
    status, _, answer = http("POST", hf_server.url + "/v1/chat/completions", body)
    assert (status, answer["error"]["code"], answer["error"]["param"]) == (400, code, param), answer


def test_stream_true_is_refused_with_a_pointer_to_the_websocket(hf_server):
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(hf_server).chat.completions.create(stream=True, **CHAT)
    assert (refused.value.code, refused.value.param) == ("unsupported_field", "stream")
    assert "/ws" in refused.value.message and "client.responses.connect()" in refused.value.message


def test_informational_and_unused_fields_are_accepted(hf_server):
    reply = sdk(hf_server).chat.completions.create(
        tools=[], tool_choice="none", user="u-1", metadata={"team": "a"}, store=False, stream=False, **CHAT)
    assert reply.choices[0].message.role == "assistant" and reply.usage.completion_tokens <= 2


def test_a_multi_turn_chat_sends_back_the_sdk_s_own_message_objects(hf_server):
    client = sdk(hf_server)
    messages = [{"role": "user", "content": "My name is Ada. Say hello."}]
    first = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, **GREEDY)
    messages += [first.choices[0].message, {"role": "user", "content": "What is my name?"}]
    second = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, **GREEDY)
    assert second.choices[0].finish_reason in ("stop", "length") and second.usage.prompt_tokens > \
        first.usage.prompt_tokens + first.usage.completion_tokens


def test_socket_frames_use_the_same_shapes_and_codes(hf_server):
    ws = WsClient(hf_server.ws_url)
    try:
        ws.generate("p", messages=[{"role": "developer", "content": "Be brief."},
                                   {"role": "user", "content": [{"type": "text", "text": "Hi"}]}], max_tokens=3)
        assert ws.collect(["p"])["p"]["final"]["type"] == "done"
        ws.generate("u", prompt="Hi", suffix="!")
        ws.generate("t", prompt="Hi", max_tokens=-1)
        ws.send({"type": "generate", "id": "m"})
        errors = {e["id"]: (e["code"], e["param"]) for e in (ws.recv(), ws.recv(), ws.recv())}
        assert errors == {"u": ("unsupported_field", "suffix"), "t": ("invalid_value", "max_tokens"),
                          "m": ("missing_field", "prompt")}
    finally:
        ws.close()


@pytest.mark.parametrize("method, path, status, allow", [
    ("GET", "/nope", 404, None),
    ("GET", "/static/nope.js", 404, None),
    ("POST", "/static/app.js", 405, {"GET", "HEAD", "OPTIONS"}),
    ("PUT", "/", 405, {"GET", "HEAD", "OPTIONS"}),
    ("GET", "/v1/models/nope/nested", 404, None),
    ("POST", "/health", 405, {"GET", "HEAD", "OPTIONS"}),
    ("GET", "/v1/chat/completions", 405, {"POST", "OPTIONS"}),
    ("DELETE", "/v1/models", 405, {"GET", "HEAD", "OPTIONS"}),
    ("POST", "/ws", 405, {"GET", "HEAD", "OPTIONS"}),
    ("GET", "/ws", 400, None),  # a plain GET, no upgrade
    ("GET", "/v1/responses", 400, None),  # the same on the Responses socket, whose POST is REST (werkzeug: 405)
    ("PUT", "/v1/responses", 405, {"GET", "HEAD", "POST", "OPTIONS"}),
])
def test_every_route_answers_json_errors(hf_server, method, path, status, allow):
    got, headers, body = http(method, hf_server.url + path)
    assert got == status and headers.get_content_type() == "application/json"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    if allow is not None:
        assert {m.strip() for m in headers["Allow"].split(",")} == allow
    if method == "GET" and status == 400:
        assert body["error"]["code"] == "invalid_handshake" and "WebSocket endpoint" in body["error"]["message"]

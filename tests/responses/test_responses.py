"""OpenAI's Responses API over REST, through the official `openai` SDK against the live server (the embedded model
on its served defaults): the response shape, conversation state with previous_response_id, the bounded store,
JSON mode through text.format, and every bad or unimplemented field refused by name with a 400."""
import json

import openai
import pytest

from app.responses.rest import NOT_IMPLEMENTED, RESPONSES
from app.responses.store import ResponseStore, StoredResponse
from app.settings import ServerSettings

from ..client import http
from ..conftest import sdk

GREEDY = {"temperature": 0}
NO_EOS = {"extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(smol_server):
    return smol_server


@pytest.fixture
def client(server) -> openai.OpenAI:
    return sdk(server)


def post(server, body, **options):
    return http("POST", server.url + "/v1/responses", body, **options)


def test_create_retrieve_and_delete(client):
    made = client.responses.create(model="smollm2", input="What is the capital of France?", max_output_tokens=40,
                                   instructions="You are a helpful assistant.", metadata={"topic": "geography"},
                                   user="ada", **GREEDY)
    assert (made.object, made.model) == ("response", client.models.list().data[0].id)
    assert made.id.startswith("resp_") and "Paris" in made.output_text
    [message] = made.output
    assert (message.type, message.role, message.content[0].type) == ("message", "assistant", "output_text")
    assert made.status == message.status == ("completed" if made.usage.output_tokens < 40 else "incomplete")
    assert (made.completed_at is not None) == (made.status == "completed") and made.tool_choice == "auto"
    usage = made.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens and 0 < usage.output_tokens <= 40
    assert usage.input_tokens_details.cached_tokens == 0
    assert (made.instructions, made.metadata, made.user, made.store) == \
        ("You are a helpful assistant.", {"topic": "geography"}, "ada", True)
    assert client.responses.retrieve(made.id).model_dump() == made.model_dump()
    client.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(made.id)
    assert gone.value.code == "response_not_found"
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(made.id)


def test_message_items_read_as_chat_messages(client):
    """developer is system, input_text parts are text: the same prompt, so the same greedy answer as chat."""
    reply = client.responses.create(model="smollm2", max_output_tokens=16, **GREEDY, input=[
        {"role": "developer", "content": "You are a helpful assistant."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}])
    chat = client.chat.completions.create(model="smollm2", max_tokens=16, **GREEDY, messages=[
        {"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Name a color."}])
    assert reply.output_text == chat.choices[0].message.content
    assert reply.usage.input_tokens == chat.usage.prompt_tokens


def test_max_output_tokens_makes_an_incomplete_response(client):
    capped = client.responses.create(model="smollm2", input="Tell me a long story.", max_output_tokens=4, **NO_EOS)
    assert (capped.status, capped.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    assert capped.usage.output_tokens == 4 and capped.output[0].status == "incomplete"
    assert capped.max_output_tokens == 4


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(model="smollm2", input="My name is Ada. Say hello.", max_output_tokens=12,
                                    instructions="Answer briefly.", **GREEDY)
    second = client.responses.create(model="smollm2", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=12, **GREEDY)
    # the previous turn's input and output, then the new input (instructions are not carried over, as OpenAI)
    chat = client.chat.completions.create(model="smollm2", max_tokens=12, **GREEDY, messages=[
        {"role": "user", "content": "My name is Ada. Say hello."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "What is my name?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id


def test_store_false_keeps_nothing(client):
    made = client.responses.create(model="smollm2", input="Hi", max_output_tokens=2, store=False)
    assert made.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="smollm2", input="Again", previous_response_id=made.id, max_output_tokens=2)
    assert (refused.value.code, refused.value.param) == ("previous_response_not_found", "previous_response_id")


def test_text_format_json_schema_is_constrained(client):
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
              "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}
    made = client.responses.create(model="smollm2", input="Invent a person.", max_output_tokens=48,
                                   text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                    "strict": True}})
    assert made.status == "completed" and made.text.format.type == "json_schema"
    person = json.loads(made.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="smollm2", input="x", text={"format": {"type": "json_schema", "name": "p",
                                                                             "schema": {"not": {}}}})
    assert (refused.value.code, refused.value.param) == ("invalid_value", "text")


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "web_search"}]), ("max_tool_calls", 2), ("reasoning", {"effort": "low"}),
    ("background", True), ("include", ["reasoning.encrypted_content"]), ("truncation", "auto"),
    ("top_logprobs", 2), ("conversation", "conv_1"), ("prompt", {"id": "p"}), ("max_tokens", 4), ("n", 2),
    ("response_format", {"type": "json_object"}), ("service_tier", "flex"),
])
def test_unimplemented_fields_are_refused_by_name(server, field, value):
    status, _, body = post(server, {"input": "Hi", field: value})
    assert status == 400 and body["error"]["code"] == "unsupported_field" and body["error"]["param"] == field


def test_values_that_ask_for_nothing_are_accepted(client):
    made = client.responses.create(model="smollm2", input="Hi", max_output_tokens=1, tools=[], tool_choice="none",
                                   truncation="disabled", parallel_tool_calls=False, include=[], reasoning=None)
    assert made.status in ("completed", "incomplete") and made.tool_choice == "none"  # as asked


def test_stream_over_http_points_to_the_websocket(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="smollm2", input="Hi", stream=True)
    assert refused.value.param == "stream" and "responses.connect()" in refused.value.message


@pytest.mark.parametrize("body, code, param", [
    ({"input": "Hi", "temperature": float("nan")}, "invalid_value", "temperature"),
    ({"input": "Hi", "top_p": 0}, "invalid_value", "top_p"),
    ({"input": "Hi", "max_output_tokens": 0}, "invalid_value", "max_output_tokens"),
    ({"input": "Hi", "max_output_tokens": 10 ** 9}, "invalid_value", "max_output_tokens"),  # past the context
    ({}, "missing_field", "input"),
    ({"input": []}, "invalid_value", "input"),
    ({"input": 5}, "invalid_value", "input"),
    ({"input": "   "}, "invalid_value", "input"),
    ({"input": "\ud800"}, "invalid_value", "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "invalid_value", "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "invalid_value", "input"),  # no c
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "unsupported_field", "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "unsupported_field",
     "input"),
    ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "unsupported_field", "input"),
    ({"input": [{"role": "user", "content": "Hi"}] * 300}, "invalid_value", "input"),
    ({"input": "Hi", "instructions": ["x"]}, "invalid_value", "instructions"),
    ({"input": "Hi", "metadata": {str(i): "v" for i in range(17)}}, "invalid_value", "metadata"),
    ({"input": "Hi", "metadata": {"k": 1}}, "invalid_value", "metadata"),
    ({"input": "Hi", "previous_response_id": "x" * 1000}, "invalid_value", "previous_response_id"),
    ({"input": "Hi", "previous_response_id": "resp_unknown"}, "previous_response_not_found", "previous_response_id"),
    ({"input": "Hi", "store": "yes"}, "invalid_value", "store"),
    ({"input": "Hi", "user": 5}, "invalid_value", "user"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "invalid_value", "text"),
    ({"input": "Hi", "text": {"verbosity": "low"}}, "unsupported_field", "text"),
    ({"input": "word " * 9000}, "context_length_exceeded", None),
])
def test_bad_requests_are_a_400_naming_the_field(server, body, code, param):
    status, _, answer = post(server, body)
    assert status == 400 and answer["error"]["code"] == code and answer["error"]["message"], answer
    if param is not None:
        assert answer["error"]["param"] == param


def test_hostile_bodies_are_refused_and_the_server_keeps_serving(server, client):
    assert post(server, b"[" * 100000 + b"]" * 100000)[2]["error"]["code"] == "invalid_json"
    assert post(server, json.dumps({"input": "x" * (2 << 20)}).encode())[0] == 413
    assert post(server, b'{"input": "Hi", "temperature": 1e-300, "max_output_tokens": 1}')[0] == 200  # greedy
    assert client.responses.create(model="smollm2", input="Hi", max_output_tokens=1).status in ("completed",
                                                                                                "incomplete")


def test_an_evicted_response_is_not_found(server, client):
    original, server.state.responses = server.state.responses, ResponseStore(max_entries=2, max_bytes=1 << 20)
    try:
        made = [client.responses.create(model="smollm2", input=f"Count to {i}", max_output_tokens=1)
                for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(made[0].id)
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="smollm2", input="Go on", previous_response_id=made[0].id)
        assert refused.value.code == "previous_response_not_found"
        assert [client.responses.retrieve(m.id).id for m in made[1:]] == [m.id for m in made[1:]]
    finally:
        server.state.responses = original


def test_a_response_in_progress_is_completed_only_while_the_store_holds_it():
    store = ResponseStore(max_entries=2, max_bytes=1 << 20)
    made = [StoredResponse.of({"id": f"resp_{i}", "status": "completed"}, ()) for i in range(3)]
    assert not store.complete(made[0])  # never started here: not kept
    store.put(StoredResponse.of({"id": "resp_0", "status": "in_progress"}, ()))
    assert store.complete(made[0]) and store.get("resp_0") is made[0]
    store.put(StoredResponse.of({"id": "resp_1", "status": "in_progress"}, ()))
    assert store.delete("resp_1") and not store.complete(made[1]) and store.get("resp_1") is None
    store.put(StoredResponse.of({"id": "resp_2", "status": "in_progress"}, ()))
    store.put(StoredResponse.of({"id": "other", "status": "completed"}, ()))
    store.put(StoredResponse.of({"id": "another", "status": "completed"}, ()))  # evicts resp_2 in progress
    assert not store.complete(made[2]) and len(store) == 2
    big = StoredResponse.of({"id": "other"}, ({"role": "user", "content": "x" * (2 << 20)},))
    assert not store.complete(big) and store.get("other") is None  # too large: its in-progress form goes too


def test_the_store_is_bounded_in_entries_and_bytes():
    store = ResponseStore(max_entries=100, max_bytes=10_000)
    entries = [StoredResponse.of({"id": f"resp_{i}"}, ({"role": "user", "content": "x" * 900},)) for i in range(50)]
    for entry in entries:
        assert store.put(entry)
        assert store.num_bytes <= 10_000
    assert len(store) == 10_000 // entries[0].num_bytes  # the newest that fit, the oldest evicted
    assert store.get("resp_0") is None and store.get("resp_49") is entries[49]
    assert not store.put(StoredResponse.of({"id": "big"}, ({"role": "user", "content": "x" * 20_000},)))
    assert store.get("big") is None and store.num_bytes == sum(e.num_bytes for e in entries[-len(store):])
    assert store.delete("resp_49") and not store.delete("resp_49")


def test_store_limits_come_from_the_environment():
    settings = ServerSettings.from_env({"LOCKSTEP_RESPONSES_STORE_ENTRIES": "7",
                                        "LOCKSTEP_RESPONSES_STORE_BYTES": "12345"})
    assert (settings.responses_store_entries, settings.responses_store_bytes) == (7, 12345)


def test_the_openapi_document_lists_exactly_the_fields_read(server):
    documented = http("GET", server.url + "/openapi.json")[2]["components"]["schemas"]["ResponseRequest"]
    read = set(RESPONSES.fields) | set(RESPONSES.aliases) | set(NOT_IMPLEMENTED)
    assert set(documented["properties"]) == read and documented["additionalProperties"] is False

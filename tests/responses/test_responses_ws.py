"""OpenAI's Responses API in WebSocket mode against the live server: the official SDK's `responses.connect()`
for a conversation, JSON mode, warm-up and errors; raw WebSocket clients for malformed events, lanes, the
waiting limit, the key, origins, frame limits and a vanished client."""
import dataclasses
import json

import openai
import pytest
import websocket
from websockets.exceptions import InvalidStatus

from app.responses import ws_session as responses_ws_session

from ..client import WsClient, http, wait_until
from ..conftest import sdk

GREEDY = {"temperature": 0}
FINAL = ("response.completed", "response.incomplete", "response.failed")
EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
          "response.output_text.delta", "response.output_text.done", "response.content_part.done",
          "response.output_item.done"]


@pytest.fixture(scope="module")
def server(smol_server):
    return smol_server


@pytest.fixture
def raw(server):
    ws = WsClient(_socket_url(server))
    yield ws
    ws.close()


def _socket_url(server) -> str:
    return server.url.replace("http://", "ws://") + "/v1/responses"


def until_final(connection) -> list:
    """SDK events up to this response's last one (or an error)."""
    events = []
    while not events or events[-1].type not in (*FINAL, "error"):
        events.append(connection.recv())
    return events


def raw_until_final(ws: WsClient, count: int = 1) -> list[dict]:
    events, finished = [], 0
    while finished < count:
        events.append(ws.recv())
        finished += events[-1]["type"] in (*FINAL, "error")
    return events


def test_a_three_turn_conversation_streams_and_continues(server):
    client = sdk(server)
    turns = [("My name is Ada. Say hello.", True), ("What is my name?", False), ("Spell it.", False)]
    made, previous = [], None
    with client.responses.connect() as connection:
        for text, store in turns:
            connection.response.create(model="smollm2", input=text, max_output_tokens=12, store=store,
                                       previous_response_id=previous, **GREEDY)
            events = until_final(connection)
            kinds = [e.type for e in events]
            deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
            assert sorted(set(kinds), key=kinds.index) == EVENTS + [kinds[-1]] and kinds[-1] in FINAL[:2]
            assert [e.sequence_number for e in events] == list(range(len(events)))
            response = events[-1].response
            assert "".join(deltas) == events[-4].text == response.output_text and len(deltas) > 1
            assert response.id == events[0].response.id and response.usage.output_tokens <= 12
            made.append(response)
            previous = response.id
    # the third turn read the whole conversation: the same greedy answer as chat with those messages
    messages = []
    for (text, _), response in zip(turns, made):
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": response.output_text}]
    chat = client.chat.completions.create(model="smollm2", messages=messages[:-1], max_tokens=12, **GREEDY)
    assert made[2].output_text == chat.choices[0].message.content
    # store: false turns lived on their socket only; the stored one is there for everyone
    assert client.responses.retrieve(made[0].id).output_text == made[0].output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(made[1].id)
    with client.responses.connect() as other:
        other.response.create(input="Go on", previous_response_id=made[1].id)
        assert other.recv().error.code == "previous_response_not_found"


def test_text_format_json_schema_over_the_socket(server):
    schema = {"type": "object", "additionalProperties": False, "required": ["city"],
              "properties": {"city": {"type": "string", "maxLength": 16}}}
    with sdk(server).responses.connect() as connection:
        connection.response.create(input="Name a city.", max_output_tokens=32, text={"format": {
            "type": "json_schema", "name": "city", "schema": schema, "strict": True}})
        final = until_final(connection)[-1]
    assert final.type == "response.completed" and set(json.loads(final.response.output_text)) == {"city"}


def test_an_error_event_leaves_the_socket_usable(server):
    with sdk(server).responses.connect() as connection:
        connection.response.create(input="Hi", temperature=-1)
        error = connection.recv()
        assert (error.type, error.status, error.error.code, error.error.param, error.error.type) == \
            ("error", 400, "invalid_value", "temperature", "invalid_request_error")
        connection.response.create(input="Hi", previous_response_id="resp_nobody")
        assert connection.recv().error.code == "previous_response_not_found"
        connection.response.create(input="Hi", max_output_tokens=3)
        assert until_final(connection)[-1].type in FINAL[:2]


def test_generate_false_prepares_a_conversation(server):
    with sdk(server).responses.connect() as connection:
        connection.response.create(generate=False, input="My name is Ada.", instructions="Answer briefly.")
        created, completed = connection.recv(), connection.recv()
        assert (created.type, completed.type) == ("response.created", "response.completed")
        assert completed.response.output == [] and completed.response.usage.total_tokens == 0
        connection.response.create(input="What is my name?", previous_response_id=completed.response.id,
                                   max_output_tokens=8, **GREEDY)
        continued = until_final(connection)[-1].response
        connection.response.create(input="What is my name?", max_output_tokens=8, **GREEDY)
        alone = until_final(connection)[-1].response
    assert continued.usage.input_tokens > alone.usage.input_tokens  # the prepared turn was read


@pytest.mark.parametrize("frame, code, param", [
    ("not json", "invalid_json", None),
    ("[" * 3000 + "]" * 3000, "invalid_json", None),
    ('{"type": "dance"}', "invalid_value", "type"),
    ('{"type": "response.create"}', "missing_field", "input"),
    ('{"type": "response.create", "input": "hi", "stream_id": 5}', "invalid_value", "stream_id"),
    ('{"type": "response.create", "input": "hi", "generate": "no"}', "invalid_value", "generate"),
    ('{"type": "response.create", "input": "hi", "background": true}', "unsupported_field", "background"),
    ('{"type": "response.create", "input": "hi", "tools": [{"type": "web_search"}]}', "unsupported_field", "tools"),
    ('{"type": "response.create", "input": "hi", "tools": [{"type": "web_search"}]}', "unsupported_field",
     "tools"),  # function tools: over REST for now
    ('{"type": "response.create", "input": "hi", "top_p": NaN}', "invalid_value", "top_p"),
    ('{"type": "response.create", "input": [{"role": "user", "content": [{"type": "input_file"}]}]}',
     "unsupported_field", "input"),
    ('{"type": "response.steer", "input": "x", "previous_response_id": "r"}', "unsupported_field", "type"),
])
def test_malformed_events_get_an_error_and_the_socket_stays_usable(raw, frame, code, param):
    raw.send(frame)
    error = raw.recv()
    assert error["type"] == "error" and error["error"]["code"] == code and error["error"]["message"]
    assert error["status"] == 400 and error["error"]["param"] == param
    raw.send({"type": "response.create", "input": "Hi", "max_output_tokens": 2})
    assert raw_until_final(raw)[-1]["type"] in FINAL[:2]


def test_lanes_run_at_once_and_a_lane_runs_in_order(raw):
    for lane in ("a", "b", "a"):
        raw.send({"type": "response.create", "input": "Hello", "max_output_tokens": 6, "ignore_eos": True,
                  "stream_id": lane})
    events = raw_until_final(raw, count=3)
    ids = [e["response"]["id"] for e in events if e["type"] == "response.created"]
    assert len(ids) == 3 and all(e["stream_id"] in ("a", "b") for e in events)
    first_a_done = next(i for i, e in enumerate(events) if e["type"] in FINAL and e["stream_id"] == "a")
    second_a_created = [i for i, e in enumerate(events) if e["type"] == "response.created"
                        and e["stream_id"] == "a"][1]
    b_created = next(i for i, e in enumerate(events) if e["type"] == "response.created" and e["stream_id"] == "b")
    assert b_created < first_a_done < second_a_created  # b beside the first a; the second a after it
    finals = [e for e in events if e["type"] in FINAL]
    assert sorted(e["response"]["id"] for e in finals) == sorted(ids)


def test_too_many_waiting_creates_and_a_vanished_client(server):
    scheduler = server.state.engine.scheduler
    ws = WsClient(_socket_url(server))
    long = {"type": "response.create", "input": "Hello", "max_output_tokens": 500, "ignore_eos": True}
    for _ in range(responses_ws_session.MAX_WAITING + 2):
        ws.send(long)
    while (event := ws.recv())["type"] != "error":
        pass
    assert event["error"]["code"] == "response_already_in_flight" and event["status"] == 409
    while ws.recv()["type"] != "response.output_text.delta":
        pass
    assert scheduler.num_running == 1
    ws.close()  # the running response is cancelled, the waiting ones never start
    wait_until(lambda: scheduler.num_running == 0 and scheduler.num_waiting == 0, timeout=30,
               what="the socket's responses cancelled")


def test_an_event_over_one_mib_is_replaced_by_an_error(raw, monkeypatch):
    monkeypatch.setattr(responses_ws_session, "MAX_FRAME_BYTES", 4096)  # a response.created that repeats instructions
    raw.send({"type": "response.create", "input": "Hi", "instructions": "Be brief. " * 500, "max_output_tokens": 2})
    events = raw_until_final(raw, count=1)
    assert events[0]["type"] == "error" and events[0]["error"]["code"] == "frame_too_large"
    assert all(len(json.dumps(e)) <= 4096 for e in events)


def test_the_key_comes_from_the_handshake(server):
    original = server.state.settings
    server.state.settings = dataclasses.replace(original, api_key="s3cret")
    try:
        keyed = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        with keyed.responses.connect() as connection:
            connection.response.create(input="Hi", max_output_tokens=2)
            assert until_final(connection)[-1].type in FINAL[:2]
        with pytest.raises(InvalidStatus) as refused:
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong").responses.connect().enter()
        assert refused.value.response.status_code == 401
        with pytest.raises(websocket.WebSocketBadStatusException) as bare:
            websocket.create_connection(_socket_url(server), timeout=10)  # no key: no first-frame auth here
        assert bare.value.status_code == 401
    finally:
        server.state.settings = original


def test_origins_and_frame_limits_are_those_of_ws(server):
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        websocket.create_connection(_socket_url(server), origin="http://evil.example", timeout=10)
    assert refused.value.status_code == 403
    ws = WsClient(_socket_url(server))
    ws.send({"type": "response.create", "input": "x" * (300 << 10)})
    opcode, data = ws.ws.recv_data(control_frame=True)
    assert opcode == websocket.ABNF.OPCODE_CLOSE and int.from_bytes(data[:2], "big") == 1009
    assert http("GET", server.url + "/health")[0] == 200


def test_a_bug_below_the_socket_is_a_server_error_event(server, raw, monkeypatch):
    def broken_submit(*args, **kwargs):  # fault injection: a bug while starting the response
        raise RuntimeError("template exploded")

    monkeypatch.setattr(server.state.engine, "submit", broken_submit)
    raw.send({"type": "response.create", "input": "Hi", "max_output_tokens": 2})
    error = raw.recv()
    assert (error["type"], error["status"], error["error"]["code"], error["error"]["type"]) == \
        ("error", 500, "internal_error", "server_error")
    monkeypatch.undo()
    raw.send({"type": "response.create", "input": "Hi", "max_output_tokens": 2})
    assert raw_until_final(raw)[-1]["type"] in FINAL[:2]


def test_a_stored_response_is_kept_from_its_start_and_a_delete_meanwhile_wins(server, raw):
    url = server.url + "/v1/responses"
    raw.send({"type": "response.create", "input": "Hello", "max_output_tokens": 500, "ignore_eos": True})
    response_id = raw.recv()["response"]["id"]
    while raw.recv()["type"] != "response.output_text.delta":
        pass
    status, _, shown = http("GET", f"{url}/{response_id}")
    assert status == 200 and shown["status"] == "in_progress" and shown["output"] == []
    status, _, refused = http("POST", url, {"input": "Go on.", "previous_response_id": response_id})
    assert status == 400 and refused["error"]["code"] == "previous_response_in_progress"
    assert http("DELETE", f"{url}/{response_id}")[0] == 200
    assert raw_until_final(raw)[-1]["type"] == "response.incomplete"  # it still streams to its end
    assert http("GET", f"{url}/{response_id}")[0] == 404  # ... and the delete holds

    raw.send({"type": "response.create", "input": "Hello", "max_output_tokens": 2})
    response_id = raw_until_final(raw)[-1]["response"]["id"]
    status, _, kept = http("GET", f"{url}/{response_id}")
    assert status == 200 and kept["status"] in ("completed", "incomplete") and kept["output"]


def test_a_socket_that_closes_forgets_its_responses_in_progress(server):
    url = server.url + "/v1/responses"
    ws = WsClient(_socket_url(server))
    ws.send({"type": "response.create", "input": "Hello", "max_output_tokens": 500, "ignore_eos": True})
    response_id = ws.recv()["response"]["id"]
    assert http("GET", f"{url}/{response_id}")[2]["status"] == "in_progress"
    ws.close()
    wait_until(lambda: http("GET", f"{url}/{response_id}")[0] == 404, timeout=30,
               what="the cancelled response forgotten")

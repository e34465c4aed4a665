"""openai-agents against a live lockstep: an agent turn (no tools) over the SDK's Responses WebSocket transport,
`set_default_openai_responses_transport("websocket")`, as issue 21 names it."""
import asyncio
import logging

import agents
import openai
import pytest
from agents.models import _openai_shared
from agents.tracing import set_tracing_disabled

from ..client import http, wait_until


@pytest.fixture(scope="module")
def server(smol_server):
    return smol_server


@pytest.fixture
def agents_on(server):
    """The SDK's defaults point at lockstep over the WebSocket for one test, and are put back after it."""
    saved = (_openai_shared.get_default_openai_client(), _openai_shared.get_default_openai_responses_transport())
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_default_openai_api("responses")
    agents.set_default_openai_responses_transport("websocket")
    set_tracing_disabled(True)  # traces would be uploaded to OpenAI
    yield
    _openai_shared.set_default_openai_client(saved[0])
    agents.set_default_openai_responses_transport(saved[1])
    set_tracing_disabled(False)


def test_an_agent_turn_runs_over_the_responses_websocket(server, agents_on, caplog):
    # One model is served whatever the name; the agent's would be read as a provider prefix if it had a slash.
    agent = agents.Agent(name="Echo", instructions="Answer with one word.", model="smollm2",
                         # room to finish: agents raise on an incomplete response
                         model_settings=agents.ModelSettings(temperature=0, max_tokens=64))
    with caplog.at_level(logging.INFO, logger="app.responses.ws_session"):
        result = asyncio.run(agents.Runner.run(agent, "Say hello."))
        [response] = result.raw_responses
        # The socket session logs each response it made, just after sending its last event (so the client may be
        # done first): this one came over /v1/responses' WebSocket, not REST.
        wait_until(lambda: any(r.name == "app.responses.ws_session"
                               and r.getMessage().startswith(f"ws response {response.response_id} ")
                               for r in caplog.records), timeout=30, what="the socket session's log of the response")
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert response.usage.output_tokens > 0
    # Its answer is the model's own: the same greedy turn over REST says the same.
    status, _, rest = http("POST", server.url + "/v1/responses", {
        "model": "smollm2", "instructions": "Answer with one word.", "input": "Say hello.",
        "temperature": 0, "max_output_tokens": 64})
    assert status == 200 and rest["output"][0]["content"][0]["text"] == result.final_output

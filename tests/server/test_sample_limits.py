"""Bounds on a request's samples and on what echo returns, against a live server: n / best_of at most
LOCKSTEP_MAX_SAMPLES, prompts x samples within a client's queue (400, never a 429 to retry forever), samples x tokens
within the KV budget (a request alone always runs: past the budget it would take memory a limit does not leave), echo only where
it is served, an echo + logprobs answer within LOCKSTEP_MAX_ECHO_LOGPROB_ENTRIES, and /openapi.json saying so."""
import pytest

from ..client import WsClient, http
from ..conftest import start_live_server

MAX_SAMPLES = 3
MAX_QUEUE_PER_CLIENT = 8
ECHO_BUDGET = 800
KV_BUDGET = 200


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    live = start_live_server(tiny_model_dir, max_batch_size=8, max_samples=MAX_SAMPLES,
                             max_queue_per_client=MAX_QUEUE_PER_CLIENT, max_echo_logprob_entries=ECHO_BUDGET,
                             max_batch_kv_tokens=KV_BUDGET)
    yield live
    live.stop()


def assert_refused(response, status: int, code: str, param: str) -> dict:
    got_status, headers, body = response
    assert got_status == status, body
    assert body["error"]["code"] == code and body["error"]["param"] == param, body
    assert "Retry-After" not in headers
    return body["error"]


@pytest.mark.parametrize("path, prompt_field", [("/basic_generate", "prompt"), ("/v1/completions", "prompt"),
                                                ("/v1/chat/completions", "messages")])
@pytest.mark.parametrize("param", ["n", "best_of"])
def test_samples_past_the_bound_are_400_naming_the_field(server, path, prompt_field, param):
    prompt = [{"role": "user", "content": "Hi"}] if prompt_field == "messages" else "Hi"
    body = {prompt_field: prompt, "max_tokens": 2, param: MAX_SAMPLES + 1}
    error = assert_refused(http("POST", server.url + path, body), 400, "invalid_value", param)
    assert f"at most {MAX_SAMPLES}" in error["message"]
    status, _, answer = http("POST", server.url + path, {**body, param: MAX_SAMPLES})
    assert status == 200, answer


@pytest.mark.parametrize("param", ["n", "best_of"])
def test_samples_that_together_pass_the_kv_budget_are_400_naming_the_field(server, param):
    body = {"model": "x", "prompt": "Hi", "max_tokens": 100, "temperature": 1.0, param: MAX_SAMPLES}
    error = assert_refused(http("POST", server.url + "/v1/completions", body), 400, "invalid_value", param)
    assert f"the {KV_BUDGET} positions of keys and values" in error["message"]
    (model,) = http("GET", server.url + "/v1/models")[2]["data"]
    assert model["max_batch_kv_tokens"] == KV_BUDGET and model["kv_budget_reason"] == ""
    assert model["kv_per_row"] is False  # a model without 4-bit blocks: a batch padded to its longest row
    status, _, answer = http("POST", server.url + "/v1/completions", {**body, param: 1})  # one sample fits
    assert status == 200, answer


def test_samples_past_the_bound_are_an_error_frame_on_the_socket(server):
    client = WsClient(server.ws_url)
    try:
        client.generate("a", prompt="Hi", max_tokens=2, n=MAX_SAMPLES + 1)
        refused = client.collect(["a"])["a"]["final"]
        assert refused["type"] == "error" and refused["code"] == "invalid_value" and refused["param"] == "n"
        client.generate("b", prompt="Hi", max_tokens=2, n=MAX_SAMPLES)
        assert len(client.collect(["b"])["b"]["final"]["choices"]) == MAX_SAMPLES
    finally:
        client.close()


@pytest.mark.parametrize("path", ["/generate", "/v1/completions"])
def test_prompts_times_samples_past_a_clients_queue_is_400_not_429(server, path):
    """On an idle server: such a request could never be queued, so retrying (429 + Retry-After) would loop."""
    field = "prompts" if path == "/generate" else "prompt"
    body = {field: ["Hi"] * (MAX_QUEUE_PER_CLIENT // 2 + 1), "max_tokens": 1, "n": 2}
    error = assert_refused(http("POST", server.url + path, body), 400, "invalid_value", "n")
    assert str(MAX_QUEUE_PER_CLIENT) in error["message"]
    body = {field: ["Hi"] * (MAX_QUEUE_PER_CLIENT + 1), "max_tokens": 1, "best_of": 1}
    assert_refused(http("POST", server.url + path, body), 400, "invalid_value", "prompts")
    status, _, answer = http("POST", server.url + path, {**body, field: ["Hi"] * (MAX_QUEUE_PER_CLIENT // 2)})
    assert status == 200, answer


@pytest.mark.parametrize("path, body", [("/basic_generate", {"prompt": "Hi"}), ("/generate", {"prompts": ["Hi"]}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})])
def test_echo_is_refused_by_name_where_it_is_not_served(server, path, body):
    body = {**body, "max_tokens": 2}
    error = assert_refused(http("POST", server.url + path, {**body, "echo": True, "logprobs": 1}), 400,
                           "unsupported_field", "echo")
    assert "/v1/completions" in error["message"]
    assert http("POST", server.url + path, {**body, "echo": False})[0] == 200


def test_echo_is_an_error_frame_on_the_socket(server):
    client = WsClient(server.ws_url)
    try:
        client.generate("a", prompt="Hi", max_tokens=2, echo=True)
        refused = client.collect(["a"])["a"]["final"]
        assert refused["type"] == "error" and refused["code"] == "unsupported_field" and refused["param"] == "echo"
    finally:
        client.close()


def echo_entries(server, prompt: str, max_tokens: int, logprobs: int) -> int:
    """Logprob entries one choice of an echo + logprobs answer carries (prompt and answer tokens x (top + 1))."""
    count = http("POST", server.url + "/tokenize", {"prompt": prompt})[2]["count"]
    return (count + max_tokens) * (logprobs + 1)


def test_an_echo_with_logprobs_answer_past_the_budget_is_400_naming_echo(server):
    prompt, max_tokens, logprobs = "Once upon a time", 2, 20
    per_choice = echo_entries(server, prompt, max_tokens, logprobs)
    fitting_prompts = ECHO_BUDGET // (per_choice * 2)
    assert 1 <= fitting_prompts and (fitting_prompts + 1) * 2 <= MAX_QUEUE_PER_CLIENT
    body = {"prompt": [prompt] * fitting_prompts, "max_tokens": max_tokens, "echo": True, "logprobs": logprobs,
            "n": 2}
    status, _, answer = http("POST", server.url + "/v1/completions", body)
    assert status == 200, answer
    choices = answer["choices"]
    assert len(choices) == fitting_prompts * 2
    assert sum(len(c["logprobs"]["top_logprobs"]) for c in choices) * (logprobs + 1) <= ECHO_BUDGET
    assert all(c["text"].startswith(prompt) for c in choices)
    body["prompt"] = [prompt] * (fitting_prompts + 1)
    error = assert_refused(http("POST", server.url + "/v1/completions", body), 400, "invalid_value", "echo")
    assert str(ECHO_BUDGET) in error["message"]
    assert http("POST", server.url + "/v1/completions", {**body, "logprobs": None})[0] == 200  # echo alone is cheap


def test_openapi_gives_the_bound_on_samples_and_echo_only_on_completions(server):
    schemas = http("GET", server.url + "/openapi.json")[2]["components"]["schemas"]
    for name in ("BasicGenerateRequest", "GenerateRequest", "CompletionRequest", "ChatRequest"):
        properties = schemas[name]["properties"]
        for param in ("n", "best_of"):
            bounded = [s for s in properties[param]["anyOf"] if s.get("type") == "integer"] \
                if "anyOf" in properties[param] else [properties[param]]
            assert bounded[0]["maximum"] == MAX_SAMPLES, (name, param, properties[param])
        assert ("echo" in properties) == (name == "CompletionRequest"), name

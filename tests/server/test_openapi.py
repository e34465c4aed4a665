"""GET /openapi.json against the live server: a valid OpenAPI 3.1 document that lists every route and exactly the
fields each request kind reads, and schemathesis's generated requests (valid and invalid, a bounded number per
operation) get documented answers: no 5xx, statuses, content types, headers and bodies as the document says, and
every schema-violating request refused with a 4xx."""
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from app.rest import request_parsing as shapes

from ..client import http

# Generated cases per operation: valid ones run the model (a few tokens each), invalid ones are refused at once.
# The module takes about a minute on two quiet cores.
VALID_EXAMPLES = 12
INVALID_EXAMPLES = 40
SMALL_MAX_TOKENS = 3  # generated bodies ask for at most this many tokens (time, not coverage)
MAX_SAMPLES = 2
MAX_PROMPTS = 2
MIN_TIMEOUT_S = 60.0  # a generated deadline of 1e-300 s would expire (504, as documented), not test the API
GENERATING = {"/basic_generate", "/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses"}
CHECKS = ["not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_headers_conformance", "response_schema_conformance"]
OPERATIONS = ["POST /basic_generate", "POST /generate", "POST /v1/completions", "POST /v1/chat/completions",
              "POST /tokenize", "GET /v1/models", "GET /v1/models/{model}", "GET /health", "GET /ready",
              "GET /metrics", "GET /openapi.json", "GET /", "GET /ws", "POST /v1/responses", "GET /v1/responses",
              "GET /v1/responses/{response_id}", "DELETE /v1/responses/{response_id}"]


@pytest.fixture(scope="module")
def server(smol_server):
    return smol_server


@pytest.fixture(scope="module")
def document(server) -> dict:
    status, headers, body = http("GET", server.url + "/openapi.json")
    assert status == 200 and headers.get_content_type() == "application/json"
    return body


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def test_the_document_is_valid_openapi_3_1(server, document):
    assert document["openapi"].startswith("3.1")
    schemathesis.openapi.from_url(server.url + "/openapi.json").validate()  # against the OpenAPI 3.1 meta-schema


@pytest.mark.parametrize("name, shape", [
    ("BasicGenerateRequest", shapes.BASIC_GENERATE), ("GenerateRequest", shapes.GENERATE),
    ("CompletionRequest", shapes.COMPLETIONS), ("ChatRequest", shapes.CHAT), ("TokenizeRequest", shapes.TOKENIZE),
])
def test_request_bodies_list_exactly_the_fields_the_server_reads(document, name, shape):
    documented = document["components"]["schemas"][name]
    read = set(shape.fields) | set(shape.aliases) | (set(shapes.NOT_IMPLEMENTED) if shape.is_openai else set())
    assert set(documented["properties"]) == read and documented["additionalProperties"] is False


def test_every_route_is_documented(server, document):
    served = set()
    for rule in server.app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = rule.rule.replace("<path:model_id>", "{model}").replace("<response_id>", "{response_id}")
        served |= {(path, method.lower()) for method in rule.methods - {"HEAD", "OPTIONS"}}
    documented = {(path, method) for path, item in document["paths"].items() for method in item}
    assert documented == served


@pytest.mark.parametrize("label", [label for label in OPERATIONS if label.startswith("POST")])
def test_the_documented_examples_succeed_as_documented(api_schema, document, label):
    method, path = label.split(" ")
    operation = api_schema[path][method]
    examples = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["examples"]
    assert examples
    for name, example in examples.items():
        case = operation.Case(body=example["value"], media_type="application/json")
        response = case.call_and_validate(checks=[getattr(schemathesis.checks, c) for c in CHECKS], timeout=120)
        assert response.status_code == 200, (name, response.text)


def test_the_operations_tested_below_are_all_the_documented_ones(document):
    assert {(method.upper(), path) for path, item in document["paths"].items() for method in item} == \
        {tuple(label.split(" ")) for label in OPERATIONS}


# schemathesis's pytest plugin does not run under pytest 9 (it reads a removed node attribute): its Python API
# with Hypothesis does the same, one test per operation and generation mode (invalid data only where there is a
# body to break).
@pytest.mark.parametrize("label, mode", [(label, GenerationMode.POSITIVE) for label in OPERATIONS] +
                         [(label, GenerationMode.NEGATIVE) for label in OPERATIONS if label.startswith("POST")],
                         ids=lambda value: value.value if isinstance(value, GenerationMode) else value)
def test_generated_requests_get_documented_answers(api_schema, label, mode):
    method, path = label.split(" ")
    operation = api_schema[path][method]
    checks = [getattr(schemathesis.checks, name) for name in CHECKS]
    examples = VALID_EXAMPLES
    if mode is GenerationMode.NEGATIVE:
        checks.append(schemathesis.checks.negative_data_rejection)
        examples = INVALID_EXAMPLES

    sent = []

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    def answers_as_documented(case):
        if path in GENERATING and mode is GenerationMode.POSITIVE:
            _bound_the_work(case.body)
        sent.append(case.body)
        case.call_and_validate(checks=checks, timeout=120)

    answers_as_documented()
    assert len(sent) >= examples // 2 or method == "GET"  # a GET without parameters has one case to send


def _bound_the_work(body) -> None:
    """Keep each valid generated request cheap, and valid: fewer prompts, a smaller max_tokens, n and best_of,
    a longer timeout. (Invalid ones are refused before any work.)"""
    if not isinstance(body, dict):
        return
    for name in ("prompts", "prompt"):
        if isinstance(body.get(name), list) and len(body[name]) > MAX_PROMPTS and not _is_int(body[name][0]):
            body[name] = body[name][:MAX_PROMPTS]
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if _is_int(body.get(name)) and body[name] > SMALL_MAX_TOKENS:
            body[name] = SMALL_MAX_TOKENS
    if body.get("max_tokens") == 0 and body.get("echo") is not True:  # 0 is for echo alone: spend the case on work
        body["max_tokens"] = 1
    if not {"max_tokens", "max_completion_tokens", "max_output_tokens"} & set(body):
        body["max_output_tokens" if "input" in body else "max_tokens"] = SMALL_MAX_TOKENS
    for name in ("n", "best_of"):
        if _is_int(body.get(name)) and body[name] > MAX_SAMPLES:
            body[name] = MAX_SAMPLES
    if _is_int(body.get("min_tokens")) and body["min_tokens"] > SMALL_MAX_TOKENS:
        body["min_tokens"] = SMALL_MAX_TOKENS
    timeout = body.get("timeout")
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < MIN_TIMEOUT_S:
        body["timeout"] = MIN_TIMEOUT_S


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

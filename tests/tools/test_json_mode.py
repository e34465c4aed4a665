"""JSON mode (`response_format`): the field's checks, the grammar mask with the real vocabulary, and greedy
JSON through the live server on both backends (REST, the `openai` SDK, /ws), batched beside plain requests."""
import json
import re

import jsonschema
import openai
import pytest

from engine import InvalidRequest, SamplingParams
from engine.backends.constrained import MAX_KEPT_EXPANSION, GrammarCompiler
from engine.response_format import MAX_EXPANSION, MAX_SCHEMA_DEPTH, parse_response_format, refuse_conflicts

from ..client import WsClient, http

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 3},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
OBJECT_FORMAT = {"type": "json_object"}
INVENT = [{"role": "user", "content": "Invent a person: their name, age and hobbies, as JSON."}]
CAT = [{"role": "user", "content": "Describe a cat as a JSON object."}]


def nested(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


# -- the field, in the parent ------------------------------------------------------------------------------------

def test_text_and_absent_mean_free_text():
    assert parse_response_format(None) is None
    assert parse_response_format({"type": "text"}) is None


def test_json_object_and_json_schema_become_a_schema_with_fixed_whitespace():
    any_object = json.loads(parse_response_format(OBJECT_FORMAT))
    assert any_object["type"] == "object"
    person = json.loads(parse_response_format(PERSON_FORMAT))
    assert {k: v for k, v in person.items() if k != "x-guidance"} == PERSON
    assert person["x-guidance"] == any_object["x-guidance"] and person["x-guidance"]["whitespace_flexible"] is False
    # the client's own grammar options are not taken (they could make whitespace free again)
    sneaky = {**PERSON, "x-guidance": {"whitespace_flexible": True}}
    parsed = json.loads(parse_response_format({"type": "json_schema", "json_schema": {"name": "p", "schema": sneaky}}))
    assert parsed["x-guidance"]["whitespace_flexible"] is False


@pytest.mark.parametrize("value, message", [
    ("json", "must be an object"),
    ({"type": "yaml"}, "response_format.type"),
    ({"type": "json_object", "schema": {}}, "does not take 'schema'"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"schema": PERSON}}, "name"),
    ({"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": PERSON}}, "name"),
    ({"type": "json_schema", "json_schema": {"name": "p"}}, "schema must be a JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": True}}, "schema must be a JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {}, "strict": "yes"}}, "strict"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {}, "format": "x"}}, "does not take 'format'"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}}, "Invalid type"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer", "minimum": 5,
                                                                      "maximum": 2}}}, "Unsatisfiable"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"not": {"type": "string"}}}}, "not"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"$ref": "#/$defs/missing"}}}, "missing"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"$ref": "http://127.0.0.1:9/x.json"}}},
     "not supported"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "string", "pattern": "(a|b"}}},
     "unclosed group"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "number", "maximum": float("nan")}}},
     "NaN or Infinity"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer", "multipleOf": 0}}},
     "multiple"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": nested(MAX_SCHEMA_DEPTH)}}, "nests deeper"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": nested(100_000)}}, "nests deeper"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"enum": ["x" * 1000] * 10_000}}},
     "too large"),
    ({"type": "json_schema", "json_schema": {"name": "p", "schema": {"description": "y" * 10_000_000}}},
     "too large"),
])
def test_bad_formats_are_refused_naming_response_format(value, message):
    with pytest.raises(InvalidRequest, match=message) as refused:
        parse_response_format(value)
    assert refused.value.param == "response_format"


def of_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}


def integers(**counts) -> dict:
    return {"type": "array", "items": {"type": "integer"}, **counts}


RECURSIVE_REQUIRED = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}},
                                                         "required": ["x"]}}}
CONTEXT_CHARS = 8192 * 81  # what a SmolLM2 answer can hold: its context x its longest token


@pytest.mark.parametrize("schema, message", [
    # llguidance spells out every item: 10**9 would allocate until the kernel kills the process (checked first)
    (integers(minItems=10 ** 9), "minItems 1000000000 is more than any answer can hold"),
    (integers(minItems=30_000_000), "can never be met"),
    (integers(minItems=CONTEXT_CHARS + 1), "can never be met"),
    ({"type": "string", "minLength": 10 ** 20}, "minLength 10000000...(21 digits)"),
    ({"type": "object", "minProperties": 10 ** 9}, "minProperties"),
    (integers(maxItems=600_000, minItems=1), "too costly"),
    (integers(maxItems=MAX_EXPANSION + 1), "too costly"),
    (integers(minItems=MAX_EXPANSION // 2, maxItems=MAX_EXPANSION // 2 + 1), "too costly"),
    ({"type": "object", "properties": {f"p{i}": integers(maxItems=100) for i in range(200)}}, "too costly"),
    ({"type": "string", "pattern": "^(a{1000}){1000}$"}, "too costly"),
    ({"type": "string", "pattern": "^((a{20}){20}){50}$"}, "too costly"),
    ({"type": "string", "pattern": "x{99999999999999999999999}"}, "too costly"),
    ({"type": "object", "patternProperties": {"^k{20000}$": {"type": "integer"}}}, "too costly"),
    # only running the grammar shows these: the check takes its first steps, on a byte vocabulary
    (RECURSIVE_REQUIRED, "Too many items"),
])
def test_counts_are_bounded_before_llguidance_sees_them(schema, message):
    with pytest.raises(InvalidRequest, match=re.escape(message)) as refused:
        parse_response_format(of_schema(schema), CONTEXT_CHARS)
    assert refused.value.param == "response_format"
    assert len(str(refused.value)) < 400 and "<state>" not in str(refused.value)  # no parser dump


def test_a_max_count_no_answer_can_reach_is_dropped_and_one_within_reach_is_kept():
    assert "maxLength" not in json.loads(parse_response_format(of_schema({"type": "string", "maxLength": 10 ** 20})))
    assert "maxItems" not in json.loads(parse_response_format(of_schema(integers(maxItems=10 ** 6)), 10 ** 5))
    kept = json.loads(parse_response_format(of_schema(integers(minItems=2, maxItems=MAX_EXPANSION - 2))))
    assert (kept["minItems"], kept["maxItems"]) == (2, MAX_EXPANSION - 2)
    # counts inside JSON values (an enum's member) are data, not schema
    assert parse_response_format(of_schema({"enum": [{"minItems": 10 ** 9}]}))


def test_a_recursive_ref_with_an_end_and_moderate_patterns_pass():
    tree = {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"x": {"$ref": "#/$defs/a"}}}}}
    assert parse_response_format(of_schema(tree))
    assert parse_response_format(of_schema({"type": "string", "pattern": "^(a{100}){100}$"}))
    assert parse_response_format(of_schema({"type": "string", "pattern": "^[{]{3}\\{{2}$"}))


def test_a_schema_just_inside_the_depth_limit_compiles():
    assert parse_response_format({"type": "json_schema",
                                  "json_schema": {"name": "deep", "schema": nested(MAX_SCHEMA_DEPTH - 1)}})


def test_stop_strings_ignore_eos_and_min_tokens_cannot_end_or_extend_json():
    with pytest.raises(InvalidRequest, match="stop strings") as refused:
        SamplingParams.from_request({"response_format": OBJECT_FORMAT, "stop": ["}"]})
    assert refused.value.param == "response_format"
    with pytest.raises(InvalidRequest, match="ignore_eos"):
        refuse_conflicts((), ignore_eos=True)
    with pytest.raises(InvalidRequest, match="min_tokens"):
        SamplingParams.from_request({"response_format": OBJECT_FORMAT, "min_tokens": 3})
    assert SamplingParams.from_request({"response_format": OBJECT_FORMAT}).for_worker(5).json_schema
    assert SamplingParams.from_request({"stop": ["}"]}).for_worker(5).json_schema is None


# -- the mask, in the worker, with the real vocabulary -------------------------------------------------------------

@pytest.fixture(scope="module")
def grammars(smol_model_dir):
    return GrammarCompiler(smol_model_dir, 49152, (2,))


@pytest.fixture(scope="module")
def tokenizer(smol_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_model_dir)


def allowed_ids(constraint, width: int = 49152) -> set[int]:
    import torch

    masked = constraint.mask(torch.zeros(width))
    return set(torch.nonzero(masked == 0).flatten().tolist())


def test_a_document_is_allowed_token_by_token_then_only_eos(grammars, tokenizer):
    constraint = grammars.constraint("json", parse_response_format(PERSON_FORMAT))
    document = '{"name": "Ada", "age": 36, "hobbies": ["math", "engines"]}'
    assert json.loads(document)
    first = allowed_ids(constraint)
    assert 2 not in first and all(document.startswith(tokenizer.decode([t])) for t in first)
    for token_id in tokenizer.encode(document, add_special_tokens=False):
        assert token_id in allowed_ids(constraint), tokenizer.decode([token_id])
        constraint.advance(token_id)
    assert allowed_ids(constraint) == {2}  # complete: only EOS, so the request stops there


def test_fixed_whitespace_and_padding_columns_are_masked(grammars, tokenizer):
    constraint = grammars.constraint("json", parse_response_format(OBJECT_FORMAT))
    for token_id in tokenizer.encode('{"a":', add_special_tokens=False):
        constraint.advance(token_id)
    allowed = allowed_ids(constraint, width=49152 + 64)  # a model whose logits are wider than its vocabulary
    assert tokenizer.encode(" 1", add_special_tokens=False)[0] in allowed
    assert not any(tokenizer.decode([t]).startswith("\n") for t in allowed)
    assert max(allowed) < 49152


def test_a_refused_token_fails_the_next_mask_not_the_advance_nor_the_next_request(grammars, tokenizer):
    schema_text = parse_response_format(OBJECT_FORMAT)
    constraint = grammars.constraint("json", schema_text)
    constraint.advance(tokenizer.encode("hello", add_special_tokens=False)[0])  # never raises: see its docstring
    with pytest.raises(ValueError, match="response_format"):
        allowed_ids(constraint)
    # the next request with the same schema starts afresh (the kept matcher is copied, never advanced)
    assert tokenizer.encode("{", add_special_tokens=False)[0] in allowed_ids(grammars.constraint("json",
                                                                                                 schema_text))


def test_kept_matchers_are_bounded_by_their_expansion(grammars):
    large = [parse_response_format(of_schema(integers(maxItems=MAX_EXPANSION - i))) for i in range(3)]
    for schema_text in large:
        grammars.constraint("json", schema_text)
    kept = grammars._fresh_matchers
    assert list(kept) == [("json", text) for text in large[-(MAX_KEPT_EXPANSION // MAX_EXPANSION):]]
    assert sum(weight for _, weight in kept.values()) <= MAX_KEPT_EXPANSION


# -- the live server, both backends ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(float32_server):
    return float32_server


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def assert_valid(text: str, schema: dict) -> dict:
    document = json.loads(text)
    jsonschema.validate(document, schema)
    return document


def test_sdk_json_schema_gives_a_matching_document_and_a_prefix_at_length(server):
    client = sdk(server)
    done = client.chat.completions.create(model="smollm2", messages=INVENT, max_tokens=120, temperature=0,
                                          response_format=PERSON_FORMAT)
    choice = done.choices[0]
    assert choice.finish_reason == "stop"
    assert_valid(choice.message.content, PERSON)
    cut = client.chat.completions.create(model="smollm2", messages=INVENT, max_tokens=6, temperature=0,
                                         response_format=PERSON_FORMAT)
    assert cut.choices[0].finish_reason == "length"
    assert choice.message.content.startswith(cut.choices[0].message.content)
    sampled = client.chat.completions.create(model="smollm2", messages=INVENT, max_tokens=200, temperature=0.8,
                                             n=2, response_format=PERSON_FORMAT)
    assert [c.finish_reason for c in sampled.choices] == ["stop", "stop"]  # each sample has its own matcher
    for sample in sampled.choices:
        assert_valid(sample.message.content, PERSON)


def test_rest_json_object_on_every_endpoint(server):
    chat = http("POST", server.url + "/v1/chat/completions",
                {"messages": CAT, "max_tokens": 150, "response_format": OBJECT_FORMAT})[2]["choices"][0]
    assert chat["finish_reason"] == "stop"
    assert isinstance(json.loads(chat["message"]["content"]), dict)
    completion = http("POST", server.url + "/v1/completions",
                      {"prompt": "A person as JSON:", "max_tokens": 120, "response_format": PERSON_FORMAT})[2]
    assert completion["choices"][0]["finish_reason"] == "stop"
    assert_valid(completion["choices"][0]["text"], PERSON)
    basic = http("POST", server.url + "/basic_generate",
                 {"prompt": "A person as JSON:", "max_tokens": 120, "response_format": PERSON_FORMAT})[2]
    assert basic["generated_text"] == completion["choices"][0]["text"]
    batch = http("POST", server.url + "/generate",
                 {"prompts": ["A person as JSON:", "A cat as JSON:"], "max_tokens": 120,
                  "response_format": PERSON_FORMAT})[2]
    assert batch["finish_reasons"] == ["stop", "stop"] and batch["generated_texts"][0] == basic["generated_text"]
    for text in batch["generated_texts"]:
        assert_valid(text, PERSON)


def test_ws_json_beside_plain_requests_leaves_theirs_as_alone(server):
    ws = WsClient(server.ws_url, timeout=300)
    try:
        plain = {"messages": CAT, "max_tokens": 40}
        ws.generate("alone-1", **plain)
        ws.generate("alone-2", prompt="1, 2, 3, 4,", max_tokens=20)
        alone = ws.collect(["alone-1", "alone-2"])
        ws.generate("plain-1", **plain)
        ws.generate("json", messages=INVENT, max_tokens=120, response_format=PERSON_FORMAT)
        ws.generate("plain-2", prompt="1, 2, 3, 4,", max_tokens=20)
        together = ws.collect(["plain-1", "json", "plain-2"])
    finally:
        ws.close()
    assert together["json"]["final"]["finish_reason"] == "stop"
    assert_valid(together["json"]["text"], PERSON)
    assert together["plain-1"]["text"] == alone["alone-1"]["text"]
    assert together["plain-2"]["text"] == alone["alone-2"]["text"]
    assert not together["plain-1"]["text"].lstrip().startswith("{")  # the mask stayed on its own row


@pytest.mark.parametrize("response_format", [
    {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "strin"}}},
    {"type": "json_schema", "json_schema": {"name": "p", "schema": nested(100)}},
    "json_object",
    of_schema(integers(minItems=10 ** 9)),
    of_schema(RECURSIVE_REQUIRED),
])
def test_bad_schemas_are_400_on_rest_sdk_and_ws_and_the_server_goes_on(server, response_format):
    status, _, body = http("POST", server.url + "/v1/chat/completions",
                           {"messages": CAT, "max_tokens": 5, "response_format": response_format})
    assert status == 400 and body["error"]["param"] == "response_format"
    assert body["error"]["code"] == "invalid_value"
    with pytest.raises(openai.BadRequestError) as refused:
        sdk(server).chat.completions.create(model="smollm2", messages=CAT, max_tokens=5,
                                            response_format=response_format)
    assert refused.value.param == "response_format"
    ws = WsClient(server.ws_url, timeout=300)
    try:
        ws.generate("bad", messages=CAT, max_tokens=5, response_format=response_format)
        error = ws.recv()
        assert error["type"] == "error" and error["id"] == "bad" and error["param"] == "response_format"
        ws.generate("good", prompt="1, 2, 3,", max_tokens=3)
        assert ws.collect(["good"])["good"]["final"]["finish_reason"] == "length"
    finally:
        ws.close()

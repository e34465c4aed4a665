"""REST against a live server (werkzeug on a real port) with the real engine and a tiny model."""
import pytest

from app.settings import ServerSettings

from ..client import http
from ..conftest import start_live_server


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    live = start_live_server(tiny_model_dir, ServerSettings(max_prompts=4, max_body_bytes=16384), max_queue=16)
    yield live
    live.stop()


def post(server, path, body, **kwargs):
    return http("POST", server.url + path, body, **kwargs)


def test_basic_generate(server, caplog):
    caplog.set_level("INFO", logger="app.guards")
    status, headers, body = post(server, "/basic_generate", {"prompt": "Hello secret", "max_tokens": 5,
                                                             "ignore_eos": True})
    assert status == 200 and body["finish_reason"] == "length"
    line = next(r.getMessage() for r in caplog.records if headers["X-Request-Id"] in r.getMessage())
    assert "POST /basic_generate status=200 tokens=5" in line and "secret" not in caplog.text
    assert body["usage"]["completion_tokens"] == 5 and body["generated_text"]
    assert body["timing"]["ttft_ms"] > 0


def test_generate_keeps_order_and_matches_single_calls(server):
    prompts = ["Hello", "A much longer prompt about the sea and the sky", "1 2 3"]
    _, _, batch = post(server, "/generate", {"prompts": prompts, "max_tokens": 8, "ignore_eos": True})
    singles = [post(server, "/basic_generate", {"prompt": p, "max_tokens": 8, "ignore_eos": True})[2]
               for p in prompts]
    assert batch["generated_texts"] == [s["generated_text"] for s in singles]
    assert batch["finish_reasons"] == ["length"] * 3 and batch["usage"]["completion_tokens"] == 24


def test_openai_completions_and_chat(server):
    status, _, body = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 4
    status, _, body = post(server, "/v1/chat/completions",
                           {"model": "x", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                            "ignore_eos": True})
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant" and body["usage"]["prompt_tokens"] > 10


def test_models_tokenize_health_ready(server):
    _, _, models = http("GET", server.url + "/v1/models")
    card = models["data"][0]
    assert card["backend"] == "hf" and card["max_model_len"] == 256 and card["ready"] is True
    assert (card["max_stop_strings"], card["max_stop_length"], card["max_prompts"]) == (8, 200, 4)  # as configured
    _, _, tokens = post(server, "/tokenize", {"prompt": "Hello world"})
    assert tokens["count"] == len(tokens["tokens"]) == 2
    assert http("GET", server.url + "/health")[0] == 200
    assert http("GET", server.url + "/ready")[2]["status"] == "ready"


def test_max_tokens_past_what_the_prompt_leaves_is_shortened_to_the_context(server):
    prompt = "word " * 200
    _, _, tokens = post(server, "/tokenize", {"prompt": prompt})
    left = 256 - tokens["count"]  # the tiny model's context
    assert 0 < left < 200
    status, _, body = post(server, "/basic_generate", {"prompt": prompt, "max_tokens": 200, "ignore_eos": True})
    assert status == 200 and body["finish_reason"] == "length"
    assert body["usage"] == {**body["usage"], "prompt_tokens": tokens["count"], "completion_tokens": left}


def test_metrics_after_traffic(server):
    post(server, "/basic_generate", {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
    _, _, text = http("GET", server.url + "/metrics")
    for name in ("lockstep:time_to_first_token_seconds_bucket", "lockstep:inter_token_latency_seconds_count",
                 "lockstep:e2e_request_latency_seconds_sum", "lockstep:request_queue_time_seconds_count",
                 "lockstep:num_requests_running", "lockstep:num_requests_waiting",
                 "lockstep:prompt_tokens_total", "lockstep:generation_tokens_total",
                 'lockstep:request_success_total{finished_reason="length"}'):
        assert name in text


@pytest.mark.parametrize("path, body, status, param", [
    ("/basic_generate", {}, 400, "prompt"),
    ("/basic_generate", {"prompt": ""}, 400, "prompt"),
    ("/basic_generate", {"prompt": 5}, 400, "prompt"),
    ("/basic_generate", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/basic_generate", {"prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ("/basic_generate", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/basic_generate", {"prompt": "x", "temperature": 10 ** 400}, 400, "temperature"),
    ("/basic_generate", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/basic_generate", {"prompt": "x", "top_p": 1.01}, 400, "top_p"),
    ("/basic_generate", {"prompt": "x", "top_k": -2}, 400, "top_k"),
    ("/basic_generate", {"prompt": "x", "stop": ["a"] * 9}, 400, "stop"),
    ("/basic_generate", {"prompt": "word " * 300}, 400, "prompt"),
    ("/generate", {"prompts": []}, 400, "prompts"),
    ("/generate", {"prompts": ["a"] * 5}, 400, "prompts"),
    ("/generate", {"prompts": ["a", 3]}, 400, "prompts"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/v1/completions", {"prompt": "x", "stream": True}, 400, "stream"),
    ("/v1/completions", {"prompt": "x", "metadata": "tag"}, 400, "metadata"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "metadata": {"k": 5}}, 400, "metadata"),
    ("/basic_generate", {"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
])
def test_bad_fields_get_an_openai_error_naming_the_field(server, path, body, status, param):
    got, _, answer = post(server, path, body)
    assert got == status
    assert answer["error"]["param"] == param and answer["error"]["message"]
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["code"] in {"missing_field", "invalid_value", "unsupported_field", "context_length_exceeded"}


@pytest.mark.parametrize("raw, content_type, status, code", [
    (b"{not json", "application/json", 400, "invalid_json"),
    (b'"a string"', "application/json", 400, "invalid_json"),
    (b'{"prompt": "\xff\xfe"}', "application/json", 400, "invalid_utf8"),
    (b'{"prompt": "x"}', "text/plain", 400, "invalid_content_type"),
    (b"[" * 3000 + b"]" * 3000, "application/json", 400, "invalid_json"),
    (b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", "application/json", 400, "invalid_json"),
    (b'{"prompt": "' + b"x" * 20000 + b'"}', "application/json", 413, "request_entity_too_large"),
])
def test_unreadable_bodies(server, raw, content_type, status, code):
    got, _, answer = post(server, "/basic_generate", raw, content_type=content_type)
    assert (got, answer["error"]["code"]) == (status, code)
    assert "Traceback" not in str(answer)


def test_unknown_route_and_method_are_json_errors(server):
    assert http("GET", server.url + "/nope")[2]["error"]["code"] == "not_found"
    # an OpenAI route this server does not serve is named (the SDK's responses.input_items.list)
    error = http("GET", server.url + "/v1/responses/resp_1/input_items")[2]["error"]
    assert error["code"] == "not_found" and error["message"].startswith("GET /v1/responses/resp_1/input_items is not")
    status, _, body = http("GET", server.url + "/basic_generate")
    assert status == 405 and body["error"]["code"] == "method_not_allowed"


def test_full_queue_answers_429_with_retry_after(server):
    engine = server.state.engine
    limit = engine.scheduler.max_queue
    engine.scheduler.max_queue = 0
    try:
        status, headers, body = post(server, "/basic_generate", {"prompt": "x"})
    finally:
        engine.scheduler.max_queue = limit
    assert status == 429 and headers["Retry-After"] and body["error"]["code"] == "overloaded"
    assert post(server, "/basic_generate", {"prompt": "x", "max_tokens": 2})[0] == 200


def test_api_key_and_origins(make_server_for, tiny_model_dir):
    live = make_server_for(tiny_model_dir, ServerSettings(api_key="sekret", allowed_origins=("http://ok.test",)))
    assert post(live, "/tokenize", {"prompt": "x"})[0] == 401
    auth = {"Authorization": "Bearer sekret"}
    assert post(live, "/tokenize", {"prompt": "x"}, headers=auth)[0] == 200
    assert http("GET", live.url + "/health")[0] == 200
    _, headers, _ = post(live, "/tokenize", {"prompt": "x"}, headers={**auth, "Origin": "http://ok.test"})
    assert headers["Access-Control-Allow-Origin"] == "http://ok.test"
    _, headers, _ = post(live, "/tokenize", {"prompt": "x"}, headers={**auth, "Origin": "http://evil.test"})
    assert "Access-Control-Allow-Origin" not in headers


def test_ready_is_503_while_the_model_loads_then_200(tiny_model_dir, monkeypatch, tmp_path):
    import functools

    from app import create_app
    from engine import EngineConfig

    from ..conftest import LiveServer
    from ..worker_faults import FileGate, load_after_gate, patch_worker

    may_load = FileGate(str(tmp_path / "may-load"))
    may_load.hold()
    patch_worker(monkeypatch, load_backend=functools.partial(load_after_gate, may_load.path))
    live = LiveServer(create_app({"ENGINE": EngineConfig(model=tiny_model_dir, dtype="float32", threads=1)}))
    try:
        status, headers, body = http("GET", live.url + "/ready")
        assert (status, body["status"], headers["Retry-After"]) == (503, "not_ready", "1")
        assert http("GET", live.url + "/health")[0] == 200
        assert post(live, "/basic_generate", {"prompt": "x"})[0] == 503  # not ready yet: a clear error
        may_load.release()
        assert live.state.engine.core.first_start_done.wait(60)
        assert http("GET", live.url + "/ready")[0] == 200
    finally:
        may_load.release()
        live.stop()

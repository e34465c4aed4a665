"""The sampling fields on lockstep's own endpoints (/basic_generate, /generate, /ws) against a live server, and
a request with every new field batched beside plain greedy ones leaves theirs unchanged."""
import pytest

from engine import SamplingParams

from ..client import WsClient, http
from ..conftest import start_live_server

GREEDY_12 = {"max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    live = start_live_server(tiny_model_dir)
    yield live
    live.stop()


def test_basic_generate_choices_and_logprobs(server):
    status, _, body = http("POST", server.url + "/basic_generate",
                           {"prompt": "Hello", "n": 2, "temperature": 1.0, "seed": 3, "logprobs": True,
                            "top_logprobs": 2, **GREEDY_12})
    assert status == 200 and [c["index"] for c in body["choices"]] == [0, 1]
    assert body["generated_text"] == body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 24
    for choice in body["choices"]:
        content = choice["logprobs"]["content"]
        assert len(content) == 12 and all(len(e["top_logprobs"]) == 2 for e in content)
    plain = http("POST", server.url + "/basic_generate", {"prompt": "Hello", **GREEDY_12})[2]
    assert "choices" not in plain


def test_generate_choices_per_prompt(server):
    status, _, body = http("POST", server.url + "/generate",
                           {"prompts": ["Hello", "Bye"], "n": 2, "logprobs": 0, **GREEDY_12})
    assert status == 200 and len(body["choices"]) == 2 and all(len(c) == 2 for c in body["choices"])
    assert body["generated_texts"] == [c[0]["text"] for c in body["choices"]]


def test_ws_deltas_carry_index_and_logprobs(server):
    client = WsClient(server.ws_url)
    try:
        client.generate("a", prompt="Hello", n=2, temperature=1.0, seed=9, logprobs=True, top_logprobs=1,
                        **GREEDY_12)
        result = client.collect(["a"])["a"]
        deltas = [e for e in result["events"] if e["type"] == "delta"]
        for index in (0, 1):
            mine = [d for d in deltas if d["index"] == index]
            entries = [e for d in mine for e in d["logprobs"]]
            assert len(entries) == 12 and "".join(d["text"] for d in mine) == "".join(e["token"] for e in entries)
        assert [c["index"] for c in result["final"]["choices"]] == [0, 1]
        assert result["final"]["usage"]["completion_tokens"] == 24
        client.generate("b", prompt="Hello", best_of=2, **GREEDY_12)
        refused = client.collect(["b"])["b"]["final"]
        assert refused["type"] == "error" and refused["param"] == "best_of"
        client.generate("c", prompt="Hello", **GREEDY_12)
        plain = client.collect(["c"])["c"]["events"]
        assert all("logprobs" not in e and "index" not in e for e in plain)
    finally:
        client.close()


def test_new_fields_beside_plain_greedy_leave_it_unchanged(server):
    engine = server.state.engine
    prompts = ["Hello there", "The quick brown fox", "Tell me a story"]
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    alone = [engine.generate([p], greedy)[0].output_token_ids for p in prompts]
    busy = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=1, n=3, logprobs=5,
                          presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2,
                          logit_bias={"42": 3.0}, min_tokens=4)
    noisy = engine.submit("Some other prompt", busy)
    together = [h.result(120).output_token_ids for h in engine.submit_many(prompts, greedy)]
    assert together == alone and len(noisy.result(120).choices) == 3

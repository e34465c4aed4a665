"""The serving benchmark (bench/serve*.py, bench/compare*.py): its client against a real lockstep server over /ws
and REST, its metrics (vLLM's definitions), the SSE reader on streams recorded from vLLM's and llama.cpp's own
servers (tests/data/sse; `python -m bench.record_sse` re-records them), the comparison run end to end on a real
gunicorn, and the command line."""
import dataclasses
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import compare, peers, probe, serve
from bench.compare_report import (ConfigResult, Plan, Report, host_class, probe_table, ratio_table,
                                  section_markers)
from bench.peers import SERVED_NAME, ServerConfig, start_server
from bench.serve_client import (LockstepRest, LockstepWebSocket, OpenAiCompletions, RequestResult, Sampling,
                                _read_event_stream, _Stopwatch)
from bench.serve_data import RequestSpec, builtin_requests, load_tokenizer, random_requests
from bench.serve_metrics import calculate, parse_slos
from app.ops.gunicorn_process import free_port
from bench.sse import iter_event_data, split_lines
from engine import SamplingParams
from engine.hardware import detect_host

from ..client import wait_until

REPO = Path(__file__).resolve().parents[2]
RECORDED = sorted((REPO / "tests" / "data" / "sse").glob("*.sse"))


@pytest.fixture(scope="module")
def tokenizer(smol_model_dir):
    return load_tokenizer(smol_model_dir)


# -- metrics: vLLM's definitions on hand-made results ---------------------------------------------------------------

def _results() -> tuple[list[RequestSpec], list[RequestResult], list[int]]:
    specs = [RequestSpec(0, "a", 5, 4), RequestSpec(1, "b", 7, 4), RequestSpec(2, "c", 3, 4)]
    results = [RequestResult(0, success=True, ttft_s=0.1, itl_s=[0.05, 0.05, 0.1], latency_s=0.3),
               RequestResult(1, success=True, ttft_s=0.2, itl_s=[0.1, 0.2], latency_s=0.5),
               RequestResult(2, success=False, error="HTTP 429: overloaded")]
    return specs, results, [4, 3, 0]


def test_metrics_follow_vllm_definitions():
    specs, results, tokens = _results()
    m = calculate(specs, results, tokens, duration_s=2.0, slos_ms={"ttft": 150})
    assert (m.num_requests, m.completed, m.failed) == (3, 2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (12, 7)  # a failed request counts neither
    assert (m.request_throughput, m.output_throughput, m.total_token_throughput) == (1.0, 3.5, 9.5)
    assert m.ttft.mean_ms == pytest.approx(150) and m.ttft.median_ms == pytest.approx(150)
    # TPOT per request = (E2E - TTFT) / (tokens - 1): 200 / 3 and 300 / 2 ms
    assert m.tpot.mean_ms == pytest.approx((200 / 3 + 150) / 2)
    assert m.itl.mean_ms == pytest.approx(100) and m.itl.median_ms == pytest.approx(100)  # pooled over requests
    assert m.e2el.median_ms == pytest.approx(400)
    assert m.request_goodput == pytest.approx(0.5)  # only the first meets TTFT <= 150 ms
    assert m.num_short_outputs == 1 and m.mean_output_tokens == 3.5


def test_unstreamed_answers_have_no_ttft_tpot_or_itl():
    specs, _, _ = _results()
    results = [RequestResult(i, success=True, latency_s=0.5, is_streaming=False) for i in range(3)]
    m = calculate(specs, results, [4, 4, 4], duration_s=1.0)
    assert m.ttft is None and m.tpot is None and m.itl is None
    assert m.e2el.mean_ms == pytest.approx(500) and m.request_goodput is None


def test_slos_are_checked():
    assert parse_slos(["ttft:200", "tpot:50", "e2el:1e4"]) == {"ttft": 200.0, "tpot": 50.0, "e2el": 1e4}
    for bad in ("ttft:nan", "ttft:inf", "tpot:-1", "tpot:0", "itl:5", "ttft:", "ttft:1e-300x"):
        with pytest.raises(ValueError):
            parse_slos([bad])


def test_poisson_arrivals_are_spread_to_the_requested_rate():
    assert serve.arrival_offsets(5, serve.LoadShape()) == [0.0] * 5  # inf: a burst
    shape = serve.LoadShape(request_rate=4.0, seed=3)
    offsets = serve.arrival_offsets(20, shape)
    assert offsets == sorted(offsets) and offsets[0] > 0
    assert offsets[-1] == pytest.approx(20 / 4.0)  # rescaled as vLLM does
    assert offsets == serve.arrival_offsets(20, shape)  # seeded
    assert offsets != serve.arrival_offsets(20, serve.LoadShape(request_rate=4.0, seed=4))


def test_prompt_sets_are_measured_in_model_tokens(tokenizer):
    builtin = builtin_requests(tokenizer, 10, output_len=100, range_ratio=0.5, seed=1)
    assert len({spec.prompt for spec in builtin}) == 10  # no two prompts alike (no shared prefix cache)
    assert all(50 <= spec.output_len <= 150 for spec in builtin)
    assert all(spec.prompt_len == len(tokenizer(spec.prompt, add_special_tokens=False).input_ids) for spec in builtin)
    randoms = random_requests(tokenizer, 5, input_len=32, output_len=16, seed=2)
    assert all(abs(spec.prompt_len - 32) <= 16 and spec.output_len == 16 for spec in randoms)
    assert randoms == random_requests(tokenizer, 5, input_len=32, output_len=16, seed=2)


# -- the SSE reader ----------------------------------------------------------------------------------------------

def test_event_stream_rules():
    stream = (b": a comment\r\nevent: message\r\nid: 7\r\ndata: {\"a\": 1}\r\n\r\n"
              b"data:first\ndata: second\n\n"
              b"retry: 10\r\rdata: cr only\r\r"
              b"data: [DONE]")  # the last event has no blank line after it
    expected = ['{"a": 1}', "first\nsecond", "cr only", "[DONE]"]
    assert list(iter_event_data(split_lines([stream]))) == expected
    for cut in range(1, len(stream)):  # however the bytes arrive
        assert list(iter_event_data(split_lines([stream[:cut], stream[cut:]]))) == expected


class _RecordedResponse:
    """An HTTP response body that arrives in the given pieces (read1 returns one piece per call)."""

    def __init__(self, pieces: list[bytes]):
        self.pieces = list(pieces)

    def read1(self, size: int) -> bytes:
        return self.pieces.pop(0) if self.pieces else b""


def _random_pieces(data: bytes, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), k=min(40, len(data) - 1)))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


def test_streams_of_vllm_and_llama_cpp_servers_are_recorded():
    assert {path.name.split("-0")[0] for path in RECORDED} == {"vllm-server", "llama-cpp"}


@pytest.mark.parametrize("recording", RECORDED, ids=lambda path: path.stem)
def test_recorded_server_streams_are_read_as_the_server_answered(recording):
    expected = json.loads(recording.with_suffix(".json").read_text())
    data = recording.read_bytes()
    for seed in range(5):
        result = RequestResult(0)
        _read_event_stream(_RecordedResponse(_random_pieces(data, random.Random(seed))), _Stopwatch(result))
        assert result.success and result.error == ""
        assert result.generated_text == expected["text"]  # the streamed pieces add up to the unstreamed answer
        assert result.finish_reason == expected["finish_reason"]
        assert result.ttft_s is not None and len(result.itl_s) >= 1
        if "stream_options" in expected["request"]:  # vLLM sends usage when asked
            assert result.server_output_tokens == expected["completion_tokens"]


def test_an_error_chunk_fails_the_request():
    stream = b'data: {"choices": [{"text": "Hi", "finish_reason": null}]}\n\ndata: {"error": {"message": "boom"}}\n\n'
    result = RequestResult(0)
    _read_event_stream(_RecordedResponse([stream]), _Stopwatch(result))
    assert not result.success and "boom" in result.error and result.generated_text == "Hi"


def test_a_server_without_ignore_eos_gets_its_special_tokens_banned(tokenizer):
    """`python -m bench serve --eos-method logit-bias`, for servers such as llama-cpp-python's."""
    sampling = Sampling(eos_method="logit-bias", banned_token_ids=tuple(tokenizer.all_special_ids))
    fields = sampling.body_fields()
    assert "ignore_eos" not in fields
    assert fields["logit_bias"][str(tokenizer.eos_token_id)] == -100
    assert Sampling().body_fields() == {"temperature": 0.0, "ignore_eos": True}


# -- against a real lockstep server --------------------------------------------------------------------------------

def _measure(target, specs, tokenizer, max_concurrency=2):
    shape = serve.LoadShape(max_concurrency=max_concurrency)
    return serve.measure(target, specs, Sampling(), shape, tokenizer, show_progress=False)


def _peak_in_flight(results: list[RequestResult]) -> int:
    events = sorted([(r.start_time, 1) for r in results] + [(r.start_time + r.latency_s, -1) for r in results])
    in_flight = peak = 0
    for _, change in events:  # an end sorts before a start at the same instant
        in_flight += change
        peak = max(peak, in_flight)
    return peak


@pytest.mark.parametrize("target_class", [LockstepWebSocket, LockstepRest])
def test_a_run_against_lockstep_is_consistent(smol_server, tokenizer, target_class):
    specs = builtin_requests(tokenizer, 3, output_len=8)
    measurement = _measure(target_class(smol_server.url), specs, tokenizer)
    m, results = measurement.metrics, measurement.outcome.results
    assert (m.num_requests, m.completed, m.failed) == (3, 3, 0)
    # ignore_eos: every request gives its 8 tokens, and our tokenizer count of the text agrees with the server's
    # usage. It may be one short: the model can emit "\n", "\n" where re-encoding the text's end gives one "\n\n"
    # (vLLM's benchmark counts the same way, and says so).
    assert [r.server_output_tokens for r in results] == [8, 8, 8]
    assert all(8 - ours in (0, 1) for ours in measurement.output_tokens)
    assert m.num_usage_mismatches == sum(ours != 8 for ours in measurement.output_tokens)
    assert m.total_output_tokens == sum(measurement.output_tokens) >= 22
    assert m.total_input_tokens == sum(s.prompt_len for s in specs)
    assert m.output_throughput == pytest.approx(m.total_output_tokens / m.duration_s)
    assert max(r.latency_s for r in results) <= m.duration_s
    assert _peak_in_flight(results) == 2  # --max-concurrency 2 with 3 requests
    assert all(r.finish_reason == "length" for r in results)
    if target_class is LockstepWebSocket:
        for r in results:
            assert 0 < r.ttft_s <= r.latency_s and len(r.itl_s) <= 7
            assert r.ttft_s + sum(r.itl_s) <= r.latency_s
        assert m.ttft.p99_ms <= m.e2el.p99_ms and m.tpot is not None
    else:
        assert m.ttft is None and m.itl is None and m.e2el.mean_ms > 0


@pytest.mark.parametrize("target_class", [LockstepWebSocket, LockstepRest])
def test_refused_requests_are_counted_as_failures(smol_server, tokenizer, target_class):
    specs = builtin_requests(tokenizer, 3, output_len=4)
    specs[1] = RequestSpec(1, specs[1].prompt, specs[1].prompt_len, output_len=0)  # max_tokens 0: refused
    measurement = _measure(target_class(smol_server.url), specs, tokenizer)
    m, results = measurement.metrics, measurement.outcome.results
    assert (m.completed, m.failed) == (2, 1)
    assert not results[1].success and "max_tokens" in results[1].error
    assert results[0].success and results[2].success  # the others are served as usual
    assert [r.server_output_tokens for r in results] == [4, None, 4]


@pytest.mark.parametrize("api", ["lockstep-ws", "lockstep-rest"])
def test_requests_past_the_deadline_are_cut_and_cancelled(smol_server, tokenizer, api):
    specs = builtin_requests(tokenizer, 2, output_len=4)
    specs[1] = RequestSpec(1, specs[1].prompt, specs[1].prompt_len, output_len=4000)  # minutes of decoding
    shape = serve.LoadShape(max_concurrency=2, deadline_s=3.0)
    measurement = serve.measure(serve.make_target(api, smol_server.url), specs, Sampling(), shape, tokenizer,
                                show_progress=False)
    first, long = measurement.outcome.results
    assert first.success and not long.success and long.error.startswith("cut: still running at the 3 s deadline")
    assert (measurement.metrics.completed, measurement.metrics.failed) == (1, 1)
    # shutting its connection down is a cancel: the server stops decoding it
    wait_until(lambda: smol_server.state.engine.scheduler.num_running == 0, timeout=30, what="the request cancelled")


@pytest.mark.parametrize("api", ["lockstep-ws", "lockstep-rest"])
def test_an_api_key_is_sent_where_the_server_asks_for_it(smol_server, tokenizer, api):
    original = smol_server.state.settings
    smol_server.state.settings = dataclasses.replace(original, api_key="s3cret")
    try:
        specs = builtin_requests(tokenizer, 1, output_len=2)
        allowed = _measure(serve.make_target(api, smol_server.url, api_key="s3cret"), specs, tokenizer)
        refused = _measure(serve.make_target(api, smol_server.url, api_key="wrong"), specs, tokenizer)
    finally:
        smol_server.state.settings = original
    assert (allowed.metrics.completed, refused.metrics.failed) == (1, 1)
    assert "401" in refused.outcome.results[0].error


def test_the_openai_client_counts_a_refused_stream(smol_server, tokenizer):
    """lockstep streams over /ws only: its /v1/completions answers `"stream": true` with a 400."""
    measurement = _measure(OpenAiCompletions(smol_server.url, "smollm2"), builtin_requests(tokenizer, 2, 4), tokenizer)
    assert (measurement.metrics.completed, measurement.metrics.failed) == (0, 2)
    assert all(r.error.startswith("HTTP 400") for r in measurement.outcome.results)
    assert measurement.metrics.e2el is None


# -- TTFT of a short prompt beside running streams (bench/probe.py) -------------------------------------------------

def _probe_plan(**changes) -> probe.ProbePlan:
    # streams far longer than the run (they are cancelled at its end), so every probe runs beside all of them
    plan = probe.ProbePlan(num_streams=3, stream_output_len=2000, num_probes=3, probe_output_len=4, min_gap_s=0.05,
                           max_gap_s=0.1, settle_timeout_s=120.0, deadline_s=240.0)
    return dataclasses.replace(plan, **changes)


def test_the_probe_measures_a_short_prompt_beside_running_streams(smol_server, tokenizer):
    result = probe.measure(lambda: LockstepWebSocket(smol_server.url), tokenizer, Sampling(), _probe_plan())
    assert result.stream_failures == 0 and result.peak_streams_decoding == 3 and result.settled_s > 0
    assert 28 <= result.prompt_tokens <= 32  # the built-in probe prompt is ~30 tokens of the model's tokenizer
    assert len(result.probes) == 3
    for p in result.probes:
        assert p.error == "" and 0 < p.ttft_ms <= p.e2e_ms
    assert result.counted == result.probes and all(p.num_streams_decoding == 3 for p in result.probes)
    summary = result.summary()
    assert (summary["counted"], summary["sent"]) == (3, 3)
    assert 0 < summary["ttft_p50_ms"] <= summary["ttft_p90_ms"] <= summary["ttft_max_ms"]
    assert "3 of 3 probes" in result.line("lockstep")
    # the streams are cancelled at the end: the server goes idle instead of decoding 2,000 tokens each
    wait_until(lambda: smol_server.state.engine.scheduler.num_running == 0, timeout=30, what="the streams cancelled")
    assert probe.ProbeResult.from_dict(json.loads(json.dumps(result.as_dict()))) == result


def test_the_probe_prompts_first_greedy_token_is_text(smol_server, tokenizer):
    """TTFT is timed by the first text: a first token without text (the end-of-turn token after a question) would
    time every server's second token instead."""
    engine = smol_server.state.engine
    specs = probe.probe_requests(tokenizer, 15, 1)
    outputs = engine.generate([spec.prompt for spec in specs], SamplingParams(max_tokens=1, ignore_eos=True))
    special = set(tokenizer.all_special_ids)
    assert [o.output_token_ids[0] in special or o.text == "" for o in outputs] == [False] * 15


def test_probes_without_the_streams_running_are_measured_but_not_counted(smol_server, tokenizer):
    """Streams that cannot run (fault injected: their client points at a closed port) never decode: the probes
    still go out, bounded by the settle timeout, and are reported but not counted."""
    targets = iter([LockstepWebSocket(f"http://127.0.0.1:{free_port()}"), LockstepWebSocket(smol_server.url)])
    plan = _probe_plan(num_streams=2, num_probes=2, settle_timeout_s=1.0)
    result = probe.measure(lambda: next(targets), tokenizer, Sampling(), plan)
    assert result.settled_s is None and result.peak_streams_decoding == 0
    assert result.stream_failures >= 2 and "ConnectionRefusedError" in result.stream_error
    assert len(result.completed) == 2 and result.counted == []
    assert all(p.num_streams_decoding == 0 for p in result.probes)
    assert result.summary() == {"counted": 0, "sent": 2}
    assert "at most 0 of 2 streams decoded at once" in result.explain_uncounted()
    wait_until(lambda: smol_server.state.engine.scheduler.num_running == 0, timeout=30, what="the server idle")


def test_bench_serve_runs_the_probe_after_its_sweep(smol_server, tmp_path):
    out = tmp_path / "serve.json"
    serve.main(["--url", smol_server.url, "--max-concurrency", "1", "--num-requests", "1", "--output-len", "2",
                "--probe", "--probe-streams", "2", "--probe-count", "1", "--result-json", str(out), "--no-progress"])
    record = json.loads(out.read_text())
    assert record["runs"][0]["metrics"]["completed"] == 1
    assert record["probe"]["summary"]["sent"] == 1 and record["probe"]["plan"]["num_streams"] == 2
    assert record["probe"]["probes"][0]["error"] == "" and record["probe"]["probes"][0]["ttft_ms"] > 0
    wait_until(lambda: smol_server.state.engine.scheduler.num_running == 0, timeout=30, what="the streams cancelled")


def _probe_result(ttfts_ms: list[float], num_streams_decoding: int = 8) -> probe.ProbeResult:
    probes = [probe.Probe(t, t + 100, num_streams_decoding) for t in ttfts_ms]
    return probe.ProbeResult(probe.ProbePlan(), 30.0, probes, settled_s=1.0 if num_streams_decoding == 8 else None,
                             peak_streams_decoding=num_streams_decoding)


def test_the_probe_table_compares_with_the_best_peer():
    results = [ConfigResult(ServerConfig("lockstep", "lockstep"), probe=_probe_result([300, 100, 200])),
               ConfigResult(ServerConfig("A", "vllm-server", is_peer=True), probe=_probe_result([40, 50, 60])),
               ConfigResult(ServerConfig("B", "llama-server", is_peer=True), probe=_probe_result([70000], 1)),
               ConfigResult(ServerConfig("C", "lockstep"), skipped="not installed: vllm")]
    header, _, mine, peer, llama = probe_table(results)
    assert "beside 8 streams" in header and "vs A" in header
    assert mine == "| lockstep | 3 / 3 | 200 / 280 / 300 | 300 | 8-8 | 4.00x |"
    assert peer == "| A | 3 / 3 | 50 / 58 / 60 | 150 | 8-8 | - |"
    assert llama.startswith("| B | 0 / 1 | none counted: at most 1 of 8 streams decoded at once") and "70000 ms" in llama
    assert probe_table(results[3:]) == []


# -- against vLLM's own OpenAI server (`make test` installs vllm; ready in ~35 s when quiet, ~110 s under load) --

@pytest.fixture(scope="module")
def vllm_server(smol_model_dir, tmp_path_factory):
    server = start_server(compare.CONFIGS["vllm-server"], smol_model_dir, tmp_path_factory.mktemp("vllm-server"))
    try:
        server.wait_ready(compare.READY_TIMEOUT_S)
        yield server
    finally:
        server.stop()
    assert server.process.poll() is not None


def test_the_openai_client_streams_from_vllm_server(vllm_server, tokenizer):
    """A real OpenAI-style SSE stream: vLLM honours ignore_eos and reports usage when asked, so our count of the text
    can be checked against its own."""
    specs = builtin_requests(tokenizer, 3, output_len=8)
    sampling = Sampling(ignore_eos=True, include_usage=True)
    measurement = serve.measure(OpenAiCompletions(vllm_server.url, SERVED_NAME), specs, sampling,
                                serve.LoadShape(max_concurrency=2), tokenizer, show_progress=False)
    m, results = measurement.metrics, measurement.outcome.results
    assert (m.completed, m.failed) == (3, 0), [r.error for r in results]
    assert [r.server_output_tokens for r in results] == [8, 8, 8]
    assert all(8 - ours in (0, 1) for ours in measurement.output_tokens)  # see the lockstep test above
    assert all(r.finish_reason == "length" and 0 < r.ttft_s <= r.latency_s and len(r.itl_s) <= 7 for r in results)
    assert m.tpot is not None and m.itl is not None


# -- the comparison, end to end on the real gunicorn -----------------------------------------------------------------

def test_compare_measures_a_configuration_and_rewrites_only_the_serving_section(tmp_path, smol_model_dir):
    docs = tmp_path / "benchmarks.md"
    begin, end = section_markers(host_class())  # this host class's section; another class's stays as it is
    other_begin, other_end = section_markers("another CPU")
    docs.write_text(f"# Benchmarks\n\nBefore.\n\n{begin}\nan older run\n{end}\n\n{other_begin}\nkept\n{other_end}\n"
                    "\nAfter.\n")
    compare.main(["--configs", "hf", "--concurrency", "1,2", "--output-len", "4", "--lengths", "6",
                  "--probe-streams", "2", "--probe-count", "2", "--out-dir", str(tmp_path / "out"), "--docs", str(docs),
                  "--no-progress"])
    report = json.loads((tmp_path / "out" / "compare.json").read_text())
    hf = report["configs"][0]
    assert hf["name"] == compare.CONFIGS["hf"].name and hf["skipped"] is None and hf["ready_s"] > 0
    points = {(p["max_concurrency"], p["output_len"]): p["metrics"] for p in hf["points"]}
    assert set(points) == {(1, 4), (2, 4), (1, 6)}
    assert points[(2, 4)]["completed"] == 4 and points[(2, 4)]["failed"] == 0
    alone = next(p for p in hf["points"] if p["output_len"] == 6)
    assert alone["metrics"]["completed"] == 1 and alone["requests"][0]["server_output_tokens"] == 6
    text = docs.read_text()
    assert text.startswith("# Benchmarks\n\nBefore.\n\n") and text.endswith("\n\nAfter.\n")
    assert text.count(begin) == 1 and text.count(end) == 1 and "an older run" not in text
    assert f"{other_begin}\nkept\n{other_end}" in text
    assert "| lockstep hf (defaults) | 2 |" in text and "![" in text and report["elapsed_s"] > 0
    assert host_class().startswith(detect_host().isa)
    plot = "bench-serving-" + "-".join(filter(None, re.split(r"[^a-z0-9]+", host_class().lower()))) + ".png"
    assert (tmp_path / plot).read_bytes().startswith(b"\x89PNG")
    assert hf["probe"]["summary"]["sent"] == 2 and hf["probe"]["plan"]["num_streams"] == 2
    assert "TTFT of a 30-token prompt beside 2 streams" in text and "| lockstep hf (defaults) | 2 / 2 |" in text
    # the same report again from compare.json, without running anything
    rendered = tmp_path / "rendered.md"
    compare.main(["--from-json", str(tmp_path / "out" / "compare.json"), "--docs", str(rendered)])
    assert _section(rendered.read_text()) == _section(text)
    # an older compare.json, from before the probe, still renders (without its table)
    del report["plan"]["probe"]
    for entry in report["configs"]:
        del entry["probe"]
    older = Report.from_dict(report).markdown_section("plot.png")
    assert "| lockstep hf (defaults) | 2 |" in older and "prompt beside" not in older
    # one from before the host class rewrites its instruction set's section, not a longer key's that starts alike
    del report["machine"]["host_class"]
    report["machine"]["isa"] = "CPU-X"
    (longer_begin, longer_end), (isa_begin, isa_end) = section_markers("CPU-X, family 1"), section_markers("CPU-X")
    mixed = tmp_path / "mixed.md"
    mixed.write_text(f"{longer_begin}\nlonger\n{longer_end}\n\n{isa_begin}\nolder\n{isa_end}\n")
    Report.from_dict(report).write_docs(mixed, tmp_path / "plot.png")
    assert f"{longer_begin}\nlonger\n{longer_end}" in mixed.read_text() and "older" not in mixed.read_text()


def _section(text: str) -> str:
    begin, end = section_markers(host_class())
    return text[text.index(begin):text.index(end)]


def _metrics(output_throughput: float, ttft_s: float):
    spec, result = RequestSpec(0, "p", 3, 4), RequestResult(0, True, ttft_s=ttft_s, latency_s=ttft_s + 1)
    return calculate([spec], [result], [round(output_throughput)], duration_s=1.0)


def test_ratios_are_against_the_best_peer_of_the_same_run():
    plan = Plan((1, 8), 128, (), 60.0, 120.0)
    results = [ConfigResult(ServerConfig("lockstep", "lockstep"), sweep={1: _metrics(20, 0.1), 8: _metrics(90, 0.3)}),
               ConfigResult(ServerConfig("A", "vllm-server", is_peer=True),
                            sweep={1: _metrics(30, 0.05), 8: _metrics(180, 0.2)}),
               ConfigResult(ServerConfig("B", "llama-server", is_peer=True),
                            sweep={1: _metrics(40, 0.02), 8: _metrics(45, 2.0)})]
    rows = ratio_table(results, plan)[2:]
    assert rows == ["| lockstep | 1 | B | **0.50x** | 5.00x |", "| lockstep | 8 | A | **0.50x** | 1.50x |"]


def test_ratios_are_against_the_peer_on_the_same_weights_where_it_ran():
    plan = Plan((1,), 128, (), 60.0, 120.0)
    results = [ConfigResult(ServerConfig("exact", "lockstep", same_weights_peer="B bf16"), sweep={1: _metrics(20, 0.1)}),
               ConfigResult(ServerConfig("A", "llama-server", is_peer=True), sweep={1: _metrics(80, 0.02)}),
               ConfigResult(ServerConfig("B bf16", "llama-server", is_peer=True), sweep={1: _metrics(40, 0.05)})]
    assert ratio_table(results, plan)[2:] == ["| exact | 1 | B bf16 | **0.50x** | 2.00x |"]


def test_the_avx2_configurations_mask_what_the_avx2_test_leg_masks_and_run_the_avx2_build():
    """`bench compare --configs hf-avx2,llama-server-avx2` is the AVX2-only host's code on this one: lockstep under
    the very masks `make test-avx2-path` proves that path with, llama-server from its AVX2 build."""
    makefile_mask = re.search(r"^AVX2_MASK := (.+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    for name in ("hf-avx2", "hf-exact-avx2"):
        settings = dict(compare.CONFIGS[name].settings)
        assert set(settings["LOCKSTEP_CPU_FLAGS_MASK"].split(",")) == set(makefile_mask.split(","))
        assert (settings["ATEN_CPU_CAPABILITY"], settings["ONEDNN_MAX_CPU_ISA"]) == ("avx2", "AVX2")
        assert compare.CONFIGS[name].same_weights_peer in {c.name for c in compare.CONFIGS.values()}
    llama = compare.CONFIGS["llama-server-avx2"]
    command = peers.llama_server_command(llama.gguf, 8080, llama.llama_build)
    assert command[0].endswith("build-avx2/bin/llama-server")
    assert peers.llama_server_command("q4_1", 8080)[0] == str(peers.LLAMA_SERVER)
    if not peers.llama_server_binary("avx2").exists():
        assert "make llama-server-avx2" in llama.missing()


def test_a_run_is_called_shared_only_if_the_machine_was_busy_before_it_started():
    """A server's own start and the previous server's run raise the 1-minute load; only the load before the run
    says whether other work shared the machine."""
    plan = Plan((1,), 128, (), 60.0, 120.0)
    after_a_busy_server = [ConfigResult(ServerConfig("A", "vllm-server", is_peer=True), load_average=3.3)]
    quiet = Report(plan, after_a_busy_server, {"load_average_at_start": 0.9, "cores": 2}, 1.0)
    busy = Report(plan, after_a_busy_server, {"load_average_at_start": 1.6, "cores": 2}, 1.0)
    assert not quiet.is_busy() and quiet._busy_warning() == []
    assert busy.is_busy() and "load average 1.6 on 2 cores when it started" in busy._busy_warning()[0]


# -- the command line ----------------------------------------------------------------------------------------------

def _bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_python_m_bench_dispatches_to_its_commands_and_modules():
    assert "--request-rate" in _bench("serve", "--help").stdout
    assert "--configs" in _bench("compare", "--help").stdout
    assert "--backends" in _bench("throughput", "--help").stdout  # the older benches still run by name


@pytest.mark.parametrize("bad", [["--request-rate", "nan"], ["--request-rate", "0"], ["--max-concurrency", "0"],
                                 ["--goodput", "ttft:inf"], ["--burstiness", "inf"], ["--range-ratio", "1"],
                                 ["--api", "openai"], ["--deadline", "nan"], ["--max-duration", "-1"],
                                 ["--temperature", "nan"], ["--probe", "--api", "lockstep-rest"],
                                 ["--probe", "--probe-streams", "0"], ["--probe", "--probe-count", "-1"]])
def test_bad_load_settings_are_refused_before_anything_runs(bad):
    run = _bench("serve", *bad)
    assert run.returncode == 2 and "error:" in run.stderr


@pytest.mark.parametrize("bad", [["--probe-streams", "0"], ["--probe-count", "0"], ["--probe-streams", "nan"]])
def test_bad_probe_settings_of_compare_are_refused(bad):
    run = _bench("compare", "--configs", "hf", *bad)
    assert run.returncode == 2 and "error:" in run.stderr

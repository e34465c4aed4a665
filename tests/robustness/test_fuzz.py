"""A bounded run of the fuzzer (tests/harness/fuzz.py) in the suite: a few hundred generated cases (REST bodies,
/ws and /v1/responses WebSocket sessions, raw HTTP) against the real gunicorn, with a checked greedy stream, a
checked REST loop and a /health prober beside it.

The server is gunicorn (not werkzeug) because raw HTTP parsing, slow clients and worker forks are gunicorn's and
the fork count is read from its log. weights=exact (float32 on the 4-bit kernels, the prefix cache on), so a
greedy answer must match its prompt answered alone exactly, cached prefix or not.
"""
import pytest

from app.ops.gunicorn_process import start_gunicorn

from ..harness.fuzz import fuzz

CASES = 500
SEED = 20261129
TIME_BOUND_S = 75


@pytest.fixture(scope="module")
def report(smol_model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "gunicorn.log"
    server = start_gunicorn(log, {"LOCKSTEP_WEIGHTS": "exact", "LOCKSTEP_DEFAULT_MAX_TOKENS": "8"})
    try:
        server.wait_ready()
        yield fuzz(server, CASES, SEED, concurrency=6, max_seconds=TIME_BOUND_S, do_minimize=False)
    finally:
        server.stop()


def problems(report, *kinds) -> list:
    return [(p["kind"], p["target"], p["count"], p["examples"][0]) for p in report["problems"] if p["kind"] in kinds]


def test_every_case_ran_within_the_time_bound(report):
    assert report["cases_total"] == CASES
    assert set(report["cases"]) == {"rest", "ws", "responses_ws", "raw"}


def test_no_5xx(report):
    assert report["http_5xx"] == 0, problems(report, "rest_5xx", "raw_5xx")
    assert problems(report, "ws_server_fault") == []


def test_every_error_has_the_json_error_shape(report):
    assert problems(report, "rest_error_shape", "ws_error_shape", "raw_non_json_error") == []


def test_every_closed_socket_had_a_close_code_and_every_open_one_answers(report):
    assert report["ws_closed_without_code"] == 0, problems(report, "ws_closed_without_code")
    assert problems(report, "ws_unresponsive", "ws_request_unfinished", "ws_closed_after_text_frame",
                    "rest_no_response") == []


def test_every_raw_http_request_gets_an_answer(report):
    """Bad chunking, oversize bodies on a kept-alive connection: a status, never silence or a cut connection."""
    assert problems(report, "raw_no_response", "raw_missing_response", "raw_unexpected_upgrade") == []


def test_the_well_formed_stream_and_rest_loop_beside_the_fuzz_succeeded(report):
    well_formed = report["well_formed"]
    assert well_formed["failed"] == 0, well_formed["failures"]
    assert well_formed["ok"].get("ws", 0) > 0 and well_formed["ok"].get("rest", 0) > 0


def test_no_model_worker_restart(report):
    assert report["worker"]["restarts"] == 0


def test_no_exception_escaped_into_the_server_log(report):
    """Every handler path ends cleanly. A slow client's 408 is logged by gunicorn, not escaped."""
    escaped = {kind: t for kind, t in report["server_log_tracebacks"].items() if not kind.endswith("ReadTimeout")}
    assert escaped == {}

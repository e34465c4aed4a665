"""The soak (tests/harness/soak.py) in its short mode: the real gunicorn (weights=exact, the prefix cache on) under
mixed load with a CPU burner on every core.

Asserts the zeros (no cross-delivered, lost or failed well-formed request, no worker restart) and flat memory:
each process ends within 10% (+40 MB of allocator noise) of its RSS after warm-up, which already includes the
long prompt's prefill, so growth here is a leak, not a first allocation.
"""
import pytest

from ..harness.soak import SoakConfig, run_soak


@pytest.fixture(scope="module")
def soak(smol_model_dir, tmp_path_factory):
    config = SoakConfig(minutes=0.75, long_tokens=1500, long_every_s=20, streamers=2, odd_pause_s=0.2)
    return run_soak(config, tmp_path_factory.mktemp("soak"))


def test_every_answer_was_delivered_to_its_own_request(soak):
    assert soak["cross_delivered"] == 0 and soak["lost"] == 0 and soak["mismatched"] == 0, soak["failures"]


def test_no_well_formed_request_failed(soak):
    assert soak["failed_well_formed"] == 0, soak["failures"]
    assert {"ws", "basic_generate", "generate", "chat", "long", "responses", "responses_ws"} <= set(soak["requests_ok"])


def test_no_model_worker_restart(soak):
    assert soak["worker"]["restarts"] == 0


def test_memory_is_flat(soak):
    assert soak["rss_flat"] == {"http_worker": True, "model_worker": True}, soak["processes"]


def test_streams_were_cancelled_and_dropped_during_the_soak(soak):
    assert soak["events"]["cancelled"] + soak["events"]["abrupt_disconnects"] > 0

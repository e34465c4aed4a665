"""How the transformers worker feeds a long prompt in steps (engine/backends/hf.py `_prefill_chunks`), on a modeled
clock: each chunk advances it by its cost units (`_cost_units`) x a fixed rate, each decode step by a fixed time, so
what is asserted does not depend on this host's speed. Alone, a step stays within ALONE_STEP_TARGET_S: a request
that arrives meanwhile waits at most that (a 512-token chunk deep in a prompt took 2.8 s on 2 cores); with it the
step keeps to prefill_step_target_s and returns its first token."""
import types

import torch

from engine.backends import hf
from engine.backends.hf import ALONE_STEP_TARGET_S, HFBackend, _cost_units
from engine.config import EngineConfig
from engine.messages import NewRequest, WorkerSampling

SECONDS_PER_UNIT = 0.002  # 512 tokens 1,000 positions into a prompt: 3.6 s
DECODE_STEP_S = 0.02
SLACK = 1.001  # float rounding


@torch.inference_mode()
def test_a_long_prompt_alone_goes_in_steps_a_newcomer_need_not_wait_out(smol_model_dir, monkeypatch):
    backend = HFBackend(EngineConfig(model=smol_model_dir, device="cpu", threads=1), smol_model_dir)
    assert backend.chunks_compute_alike  # the 4-bit path: chunks follow the clock
    clock = [0.0]
    monkeypatch.setattr(hf, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    decoder, prefill, prefill_many, decode = (backend.fast_decoder, backend.fast_decoder.prefill,
                                              backend.fast_decoder.prefill_many, backend.fast_decoder.decode)

    def costly_prefill(token_ids, start, cache, all_positions=False):
        clock[0] += SECONDS_PER_UNIT * _cost_units(start, len(token_ids))
        return prefill(token_ids, start, cache, all_positions)

    def costly_prefill_many(chunks):
        clock[0] += sum(SECONDS_PER_UNIT * _cost_units(start, len(ids)) for ids, start, _ in chunks)
        return prefill_many(chunks)

    def costly_decode(*args):
        clock[0] += DECODE_STEP_S
        return decode(*args)

    monkeypatch.setattr(decoder, "prefill", costly_prefill)
    monkeypatch.setattr(decoder, "prefill_many", costly_prefill_many)
    monkeypatch.setattr(decoder, "decode", costly_decode)

    def step(new=()):
        started = clock[0]
        output = backend.step(tuple(new), ())
        assert output.failed == {}
        return output, clock[0] - started

    long = NewRequest("long", tuple((13 * i) % 20000 + 100 for i in range(2000)), WorkerSampling(max_tokens=4))
    output, _ = step([long])  # untimed: the budget's worth (512 tokens)
    alone = []
    while "long" not in output.new_token_ids and len(alone) < 3:
        output, seconds = step()
        alone.append(seconds)
    assert len(alone) == 3 and max(alone) <= ALONE_STEP_TARGET_S * SLACK, alone
    short = NewRequest("short", tuple(range(200, 230)), WorkerSampling(max_tokens=3))
    output, seconds = step([short])
    assert "short" in output.new_token_ids and seconds <= backend.prefill_step_target_s * SLACK
    beside = []
    while "long" not in output.new_token_ids:
        output, seconds = step()
        beside.append(seconds)
    assert max(beside) <= (backend.prefill_step_target_s + DECODE_STEP_S) * SLACK, beside
    backend.close()

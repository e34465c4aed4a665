"""The engine on a CUDA GPU (`LOCKSTEP_DEVICE=cuda`): the parent never touches CUDA before it forks the worker, and
the worker's answers on the GPU keep the engine's promises (KV cache == recompute, batched == alone, a killed worker
replaced, cancel, deadlines, JSON mode, logprobs). `make gpu-check` runs these on a GPU host; elsewhere they are
collected and skipped, naming the missing GPU."""
import json
import os
import signal
import time

import pytest

from engine import FinishReason, SamplingParams
from engine.backend_choice import has_cuda_device

from ..torch_jobs import run_job

# Decided from the driver's device node and torch's build, never by asking torch (which could initialise CUDA here,
# in the process that forks the workers).
NO_GPU_REASON = "no CUDA GPU on this host (no /dev/nvidiactl or a CPU-only torch); `make gpu-check` runs these on one"


def _torch_has_cuda_build() -> bool:
    import torch

    return torch.version.cuda is not None


pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not (has_cuda_device() and _torch_has_cuda_build()), reason=NO_GPU_REASON)]

# On a GPU host without the embedded model's package, `make gpu-check` names a folder holding its tokenizer.
TOKENIZER_ENV = "LOCKSTEP_GPU_CHECK_TOKENIZER"
PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog and keeps on running through the forest",
           "Tell me a story about dragons."]
GREEDY_32 = SamplingParams(max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def gpu_model_dir(tmp_path_factory, request) -> str:
    tokenizer_dir = os.environ.get(TOKENIZER_ENV) or request.getfixturevalue("smol_model_dir")
    return run_job("build_tiny_model", target=str(tmp_path_factory.mktemp("tiny-llama-gpu")), architecture="llama",
                   tokenizer_dir=tokenizer_dir)


@pytest.fixture
def gpu_engine(make_engine, gpu_model_dir):
    def start(**settings):
        return make_engine(gpu_model_dir, device="cuda", **settings)
    return start


def test_the_worker_computes_on_the_gpu_and_the_parent_never_initialised_cuda(gpu_engine):
    import torch

    engine = gpu_engine()
    assert engine.info.device.startswith("cuda") and engine.executor.pid != os.getpid()
    assert engine.generate(["Hi"], SamplingParams(max_tokens=4))[0].finish_reason is FinishReason.LENGTH
    assert not torch.cuda.is_initialized(), "the parent initialised CUDA: the next fork of the worker would break"


def test_kv_cached_decode_equals_full_recompute_on_the_gpu(gpu_engine, gpu_model_dir):
    engine = gpu_engine()
    prompts = [engine.encode(p) for p in PROMPTS]
    expected = run_job("recompute_greedy", model_dir=gpu_model_dir, prompts=prompts, num_tokens=32, device="cuda")
    got = [list(o.output_token_ids) for o in engine.generate(PROMPTS, GREEDY_32)]
    assert got == expected and all(len(set(ids)) >= 4 for ids in got)


def test_batched_prompts_match_each_alone_on_the_gpu(gpu_engine):
    engine = gpu_engine()
    alone = [engine.generate([p], GREEDY_32)[0].output_token_ids for p in PROMPTS]
    together = [o.output_token_ids for o in engine.generate(PROMPTS, GREEDY_32)]
    assert together == alone and all(len(ids) == 32 for ids in alone)


def test_a_killed_gpu_worker_fails_its_requests_and_is_replaced(gpu_engine):
    engine = gpu_engine()
    handle = engine.submit("Hello", SamplingParams(max_tokens=200, ignore_eos=True))
    next(iter(handle))
    old_pid = engine.executor.pid
    os.kill(old_pid, signal.SIGKILL)
    assert handle.result(timeout=60).error_code == "worker_failed"
    after = engine.generate(["Hi"], SamplingParams(max_tokens=4), timeout=120)[0]
    assert after.finish_reason is FinishReason.LENGTH and engine.executor.pid != old_pid


def test_cancel_and_a_deadline_free_their_slots_on_the_gpu(gpu_engine):
    engine = gpu_engine(max_batch_size=1)
    cancelled = engine.submit("Hello", SamplingParams(max_tokens=200, ignore_eos=True))
    next(iter(cancelled))
    assert cancelled.cancel()
    assert cancelled.result(timeout=60).finish_reason is FinishReason.ABORT
    late = engine.submit("Hello", SamplingParams(max_tokens=200, ignore_eos=True), timeout_s=0.5)
    next(iter(late))
    os.kill(engine.executor.pid, signal.SIGSTOP)  # a slow stretch: the deadline passes
    time.sleep(0.8)
    os.kill(engine.executor.pid, signal.SIGCONT)
    assert late.result(timeout=60).error_code == "deadline_exceeded"
    assert engine.generate(["Hi"], SamplingParams(max_tokens=4), timeout=60)[0].finish_reason is FinishReason.LENGTH
    assert engine.num_running == 0 and engine.num_waiting == 0


def test_json_mode_and_logprobs_on_the_gpu(gpu_engine):
    engine = gpu_engine()
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    sampling = SamplingParams.from_request({"max_tokens": 40, "logprobs": True, "top_logprobs": 3,
                                            "response_format": {"type": "json_schema",
                                                                "json_schema": {"name": "a", "schema": schema}}})
    output = engine.generate(["Answer in JSON."], sampling, timeout=120)[0]
    assert json.loads(output.text)["answer"] in ("yes", "no") and output.finish_reason is FinishReason.STOP
    # one entry per token of the answer (the ending EOS is no part of it)
    assert [entry.token_id for entry in output.logprobs] == list(output.output_token_ids[:len(output.logprobs)])
    assert len(output.logprobs) >= len(output.output_token_ids) - 1
    for entry in output.logprobs:
        ranked = [logprob for _, logprob in entry.top]
        assert len(ranked) == 3 and ranked == sorted(ranked, reverse=True) and all(lp <= 0 for lp in ranked)


def test_a_gguf_file_is_served_on_the_gpu_from_its_weights_read_in_bfloat16(make_engine, tmp_path, request):
    """A GGUF on CUDA: its weights dequantized (gguf-py's numbers) and cast to bfloat16 for the model's own forward on
    the GPU, from a prepared folder's float32 copy or, for a file too big for one, from the file itself: the same
    parameters, so the same greedy tokens."""
    from engine.model_store import prepare_gguf_model

    tokenizer_dir = os.environ.get(TOKENIZER_ENV) or request.getfixturevalue("smol_model_dir")
    files = run_job("build_gguf_models", target=str(tmp_path / "gguf"), families=["qwen2"],
                    tokenizer_dir=tokenizer_dir)["qwen2"]
    answers = []
    for weights in (True, False):
        cache_dir = str(tmp_path / f"cache-{weights}")
        prepare_gguf_model(files["gguf"], cache_dir, weights=weights)
        engine = make_engine(files["gguf"], cache_dir=cache_dir, device="cuda", dtype="bfloat16")
        assert engine.info.device.startswith("cuda") and engine.info.dtype == "bfloat16"
        answers.append([output.output_token_ids for output in engine.generate(PROMPTS, GREEDY_32)])
        engine.shutdown()
    assert answers[0] == answers[1] and len({tuple(tokens) for tokens in answers[0]}) == len(PROMPTS)

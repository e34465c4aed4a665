"""The engine with a real forked worker: KV cache, batching, sampling, streaming, stops, cancel, limits."""
import threading
import time

import pytest

from engine import FinishReason, InvalidRequest, Overloaded, PromptTooLong, SamplingParams

from ..torch_jobs import run_job

PROMPTS = ["Hi", "The quick brown fox jumps over the lazy dog and keeps on running through the forest",
           "Tell me a story about dragons."]
GREEDY_32 = SamplingParams(max_tokens=32, ignore_eos=True)


MODEL_FIXTURES = {"tiny": "tiny_model_dir", "tiny_opt": "tiny_opt_dir", "smol": "smol_model_dir"}


def assert_not_degenerate(outputs):
    """A random model that repeats one token would make every comparison below pass trivially."""
    assert all(len(set(ids)) >= 4 for ids in outputs), outputs


@pytest.mark.parametrize("model, num_tokens", [("tiny", 32), ("tiny_opt", 32), ("smol", 32)])
def test_kv_cached_decode_equals_full_recompute(make_engine, request, model, num_tokens):
    model_dir = request.getfixturevalue(MODEL_FIXTURES[model])
    engine = make_engine(model_dir)
    prompts = [engine.encode(p) for p in PROMPTS]
    # the engine's own weights: on the embedded model, its 4-bit blocks (the default where they load)
    weights = "q4" if engine.info.weights == "q4_1" else "exact"
    expected = run_job("recompute_greedy", model_dir=model_dir, prompts=prompts, num_tokens=num_tokens,
                       weights=weights)
    got = [list(o.output_token_ids)
           for o in engine.generate(PROMPTS, SamplingParams(max_tokens=num_tokens, ignore_eos=True))]
    assert got == expected
    assert_not_degenerate(got)


@pytest.mark.parametrize("model", ["tiny", "tiny_opt", "smol"])
def test_batched_prompts_of_different_lengths_match_each_alone(make_engine, request, model):
    engine = make_engine(request.getfixturevalue(MODEL_FIXTURES[model]))
    alone = [engine.generate([p], GREEDY_32)[0].output_token_ids for p in PROMPTS]
    together = [o.output_token_ids for o in engine.generate(PROMPTS, GREEDY_32)]
    assert together == alone and all(len(ids) == 32 for ids in alone)
    assert_not_degenerate(alone)


def test_requests_joining_a_running_batch_match_each_alone(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    alone = [engine.generate([p], GREEDY_32)[0].output_token_ids for p in PROMPTS]
    first = engine.submit(PROMPTS[0], GREEDY_32)
    stream = iter(first)
    for _ in range(5):  # the others join while the first is mid-generation
        next(stream)
    later = [engine.submit(p, GREEDY_32) for p in PROMPTS[1:]]
    got = [h.result(timeout=60).output_token_ids for h in [first, *later]]
    assert got == alone


@pytest.mark.parametrize("policy", ["static", "none"])
def test_every_policy_gives_the_same_greedy_text(make_engine, tiny_model_dir, policy):
    continuous = make_engine(tiny_model_dir).generate(PROMPTS, GREEDY_32)
    other = make_engine(tiny_model_dir, policy=policy).generate(PROMPTS, GREEDY_32)
    assert [o.text for o in other] == [o.text for o in continuous]


def test_same_seed_same_sample_other_seed_other_sample(make_engine, smol_model_dir):
    engine = make_engine(smol_model_dir, dtype="bfloat16")
    def sample(seed):
        params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=seed, ignore_eos=True)
        return engine.generate(["Write a poem about the sea."], params)[0].text
    first = sample(1234)
    assert sample(1234) == first
    assert sample(99) != first


@pytest.mark.parametrize("prompt", [
    # Korean on every path (float32, bfloat16 on oneDNN or on lockstep's kernels), cut mid-word by max_tokens
    "Write the Korean greeting 안녕하세요 three times.",
    "Reply with many emoji only: 🎉🎊🍕👨‍👩‍👧‍👦🚀",
])
def test_streamed_multibyte_text_has_no_replacement_chars(make_engine, smol_model_dir, prompt):
    engine = make_engine(smol_model_dir, dtype="bfloat16")
    handle = engine.submit(messages=[{"role": "user", "content": prompt}],
                           sampling=SamplingParams(max_tokens=48))
    deltas = list(handle)
    output = handle.result()
    assert "".join(deltas) == output.text
    assert "\ufffd" not in output.text
    assert any(ord(ch) > 0x2000 for ch in output.text), output.text  # the model did emit multi-byte text


def test_stop_string_ends_the_request_and_is_never_streamed(make_engine, smol_model_dir):
    engine = make_engine(smol_model_dir, dtype="bfloat16")
    handle = engine.submit("1, 2, 3, 4,", SamplingParams(max_tokens=40, stop=["8,"]))
    deltas = list(handle)
    output = handle.result()
    assert output.finish_reason is FinishReason.STOP
    assert output.text.strip() == "5, 6, 7,"
    assert "".join(deltas) == output.text and not any("8" in d for d in deltas)


def test_cancel_aborts_and_frees_the_slot_at_the_next_step(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    handle = engine.submit("Hello", SamplingParams(max_tokens=200, ignore_eos=True))
    next(iter(handle))
    assert handle.cancel()
    output = handle.result(timeout=30)
    assert output.finish_reason is FinishReason.ABORT and output.usage.completion_tokens < 200
    assert engine.num_running == 0
    # The worker frees its KV cache with the next scheduler step; after it, a bare step decodes nothing.
    deadline = time.monotonic() + 10
    while engine.executor.step((), ()).output.new_token_ids:
        assert time.monotonic() < deadline, "the worker kept the cancelled request"


def test_full_queue_raises_overloaded_and_loses_nothing(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_batch_size=1, max_queue=2)
    running = engine.submit("Hello", SamplingParams(max_tokens=100, ignore_eos=True))
    next(iter(running))
    queued = [engine.submit("Hi", SamplingParams(max_tokens=2)) for _ in range(2)]
    with pytest.raises(Overloaded):
        engine.submit("one too many", SamplingParams(max_tokens=2))
    assert running.result(timeout=60).finish_reason is FinishReason.LENGTH
    assert [q.result(timeout=60).finish_reason for q in queued] == [FinishReason.LENGTH] * 2


def test_context_limits(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir)  # max_position_embeddings = 256
    with pytest.raises(PromptTooLong):
        engine.submit(prompt_token_ids=[42] * 256)
    with pytest.raises(InvalidRequest):
        engine.submit("Hi", SamplingParams(max_tokens=257))
    output = engine.submit(prompt_token_ids=[42] * 250, sampling=SamplingParams(max_tokens=100,
                                                                                   ignore_eos=True)).result()
    assert output.finish_reason is FinishReason.LENGTH and output.usage.completion_tokens == 6


def test_chat_messages_go_through_the_chat_template(make_engine, smol_model_dir):
    engine = make_engine(smol_model_dir, dtype="bfloat16")
    ids = engine.encode(messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "<|im_start|>assistant" in engine.tokenizer.decode(ids)
    output = engine.submit(messages=[{"role": "user", "content": "What is the capital of France?"}],
                           sampling=SamplingParams(max_tokens=30)).result()
    assert "Paris" in output.text and output.finish_reason is FinishReason.STOP


def test_shutdown_leaves_no_process_or_thread(make_engine, tiny_model_dir):
    # Other modules' servers (shared per xdist worker) may run their own schedulers in this process,
    # so only the threads this engine started are this test's to check.
    threads_before = set(threading.enumerate())
    engine = make_engine(tiny_model_dir)
    engine.generate(["Hi"], SamplingParams(max_tokens=3))
    worker = engine.executor._process
    started = [t for t in threading.enumerate() if t not in threads_before]
    assert [t.name for t in started].count("lockstep-scheduler") == 1
    engine.shutdown()
    assert not worker.is_alive()
    for thread in started:  # a closed queue's feeder thread ends on its own, just after
        thread.join(timeout=5.0)
    assert not [t for t in started if t.is_alive()]

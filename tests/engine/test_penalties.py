"""The worker's logits processors (vLLM semantics), on the sampler alone and in the transformers backend."""
import math

import pytest
import torch

from engine import EngineConfig
from engine.backends.hf import HFBackend
from engine.backends.sampler import TokenSampler, _nucleus, keep_top_p
from engine.detokenizer import IncrementalDetokenizer
from engine.messages import NewRequest, WorkerSampling

CPU = torch.device("cpu")


def vllm_penalties(logits: list[float], prompt: list[int], output: list[int], repetition: float, frequency: float,
                   presence: float) -> list[float]:
    """vLLM's apply_penalties, written out per token."""
    result = []
    for token, logit in enumerate(logits):
        if token in prompt or token in output:
            logit = logit / repetition if logit > 0 else logit * repetition
        count = output.count(token)
        result.append(logit - frequency * count - presence * (count > 0))
    return result


class Recording(TokenSampler):
    """Sees the logits the draw sees."""

    def _draw(self, logits):
        self.seen_logits = logits.clone()
        return super()._draw(logits)


def test_penalties_match_vllm_formula():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    sampling = WorkerSampling(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25)
    sampler = Recording(sampling, CPU, prompt_token_ids=(1, 2))
    for token in (3, 3, 4):
        sampler(logits)
        sampler.accept(token)
    sampler(logits)
    expected = vllm_penalties(logits.tolist(), [1, 2], [3, 3, 4], 1.3, 0.4, 0.25)
    assert sampler.seen_logits.tolist() == pytest.approx(expected)


def test_logit_bias_and_min_tokens():
    logits = torch.tensor([0.0, 1.0, 5.0, 2.0])
    sampler = Recording(WorkerSampling(logit_bias=((0, 10.0), (2, -100.0)), min_tokens=2, stop_token_ids=(0,)), CPU)
    assert int(sampler(logits)) == 3  # 0 is held back by min_tokens, 2 pushed down by the bias
    assert sampler.seen_logits[0] == -math.inf and sampler.seen_logits[2] == -95.0
    sampler.accept(3)
    assert int(sampler(logits)) == 3
    sampler.accept(3)
    assert int(sampler(logits)) == 0  # min_tokens reached: the bias wins


def test_defaults_change_nothing():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(1))
    plain, recorded = TokenSampler(WorkerSampling(), CPU), Recording(WorkerSampling(), CPU)
    assert int(plain(logits)) == int(recorded(logits)) == int(logits.argmax())
    assert torch.equal(recorded.seen_logits, logits)
    assert recorded.accept(int(logits.argmax())) is None  # no logprobs unless asked


def test_logprobs_are_the_raw_distribution_whatever_the_processors():
    logits = torch.tensor([1.0, 2.0, 3.0, 0.5])
    raw = torch.log_softmax(logits, -1)
    sampler = TokenSampler(WorkerSampling(logprobs=2, logit_bias=((0, 50.0),), temperature=0.0), CPU)
    token = int(sampler(logits))
    entry = sampler.accept(token)
    assert token == 0 and entry.token_id == 0 and entry.logprob == pytest.approx(raw[0].item())
    assert [i for i, _ in entry.top] == [2, 1]
    assert [v for _, v in entry.top] == pytest.approx([raw[2].item(), raw[1].item()])


# -- in the transformers backend (in this process, one torch thread: see conftest) ----------------------------


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    return HFBackend(EngineConfig(model=tiny_model_dir, dtype="float32", device="cpu", threads=1), tiny_model_dir)


def run(backend, request: NewRequest, steps: int) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for step in range(steps):
        output = backend.step((request,) if step == 0 else (), ())
        for request_id, ids in output.new_token_ids.items():
            tokens.setdefault(request_id, []).extend(ids)
    backend.step((), tuple(tokens))
    return tokens


def test_logit_bias_forces_a_token_in_the_backend(backend):
    tokens = run(backend, NewRequest("b", (1, 2, 3), WorkerSampling(max_tokens=6, logit_bias=((77, 100.0),))), 6)
    assert tokens["b"] == [77] * 6


def test_min_tokens_holds_back_the_stop_tokens(backend):
    greedy = run(backend, NewRequest("g", (4, 5, 6), WorkerSampling(max_tokens=4)), 4)["g"]
    held = WorkerSampling(max_tokens=4, min_tokens=3, stop_token_ids=(greedy[0], greedy[1]))
    tokens = run(backend, NewRequest("m", (4, 5, 6), held), 4)["m"]
    assert not {greedy[0], greedy[1]} & set(tokens[:3])


def test_frequency_penalty_counts_each_generated_token(backend):
    # +100 makes token 77 the greedy pick; after it was generated once, a frequency penalty of 200 rules it out.
    sampling = WorkerSampling(max_tokens=6, logit_bias=((77, 100.0),), frequency_penalty=200.0)
    tokens = run(backend, NewRequest("f", (1, 2, 3), sampling), 6)["f"]
    assert tokens[0] == 77 and 77 not in tokens[1:]


def test_repetition_penalty_covers_the_prompt(backend):
    # Token 77 forced by its bias unless it is in the prompt, where a huge repetition penalty shrinks its logit.
    sampling = WorkerSampling(max_tokens=2, logit_bias=((77, 30.0),), repetition_penalty=1e6)
    assert 77 in run(backend, NewRequest("a", (1, 2, 3), sampling), 2)["a"]
    assert 77 not in run(backend, NewRequest("b", (1, 77, 3), sampling), 2)["b"]


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_stop_strings_count_only_past_min_tokens():
    detokenizer = IncrementalDetokenizer(CharTokenizer(), stop=("b",), min_tokens=3)
    for char in "abab":
        detokenizer.add_token(ord(char))
    assert detokenizer.stopped_by == "b" and detokenizer.text == "aba"  # the "b" at token 2 did not stop it


@pytest.mark.parametrize("scale", [0.5, 3.0, 10.0])  # flat (the full sort) to peaked (the candidates suffice)
def test_top_p_keeps_exactly_what_a_full_sort_keeps(scale):
    generator = torch.Generator().manual_seed(int(scale * 10))
    for _ in range(20):
        probs = torch.softmax(torch.randn(49152, generator=generator) * scale, -1)
        for top_p in (0.1, 0.9, 0.999):
            assert torch.equal(keep_top_p(probs, top_p), _nucleus(probs, *torch.sort(probs, descending=True), top_p))


def test_plain_greedy_is_only_said_of_a_sampler_with_nothing_to_do():
    assert TokenSampler(WorkerSampling(), CPU).is_plain_greedy
    for sampling in (WorkerSampling(temperature=1.0), WorkerSampling(logprobs=0), WorkerSampling(min_tokens=2),
                     WorkerSampling(logit_bias=((1, 1.0),)), WorkerSampling(presence_penalty=0.1)):
        assert not TokenSampler(sampling, CPU).is_plain_greedy

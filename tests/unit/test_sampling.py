"""SamplingParams validation and the worker's logits -> token ladder."""
import pickle

import pytest
import torch

from engine import InvalidRequest, SamplingParams
from engine.backends.sampler import TokenSampler, keep_top_p, logits_to_probs
from engine.messages import (EchoResult, EchoTask, ModelInfo, NewRequest, ShutdownTask, StepOutput, StepResult,
                             StepTask, WorkerFailure, WorkerReady, WorkerSampling)


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "5"}, "max_tokens"), ({"temperature": -0.1}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"stop": [1]}, "stop"), ({"stop": ["a"] * 9}, "stop"), ({"stop": [""]}, "stop"),
    ({"seed": -2**63 - 1}, "seed"), ({"seed": 2**63}, "seed"), ({"seed": 1.5}, "seed"),
    ({"max_tokens": True}, "max_tokens"),
])
def test_bad_sampling_fields_name_the_field(body, param):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams.from_request(body)
    assert info.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": -1, "echo": True}, "max_tokens"), ({"max_tokens": 0, "echo": False}, "max_tokens"),
    ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens"),
])
def test_max_tokens_0_is_for_echo_alone(body, param):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams.from_request(body)
    assert info.value.param == param
    prompt_only = SamplingParams.from_request({"max_tokens": 0, "echo": True, "n": 2, "best_of": 3, "logprobs": 1})
    assert prompt_only.is_prompt_only and prompt_only.num_samples == 2  # nothing generated: nothing to rank


def test_good_sampling_fields():
    params = SamplingParams.from_request({"max_tokens": 5, "temperature": 0.7, "top_p": 0.9, "top_k": 40,
                                          "stop": "\n", "seed": 3})
    assert params.stop == ("\n",) and params.for_worker(5) == WorkerSampling(0.7, 0.9, 40, 3, 5)


def test_top_k_keeps_only_the_k_best():
    probs = logits_to_probs(torch.tensor([1.0, 3.0, 2.0, 0.0]), temperature=1.0, top_k=2, top_p=1.0)
    assert probs[0] == 0 and probs[3] == 0 and probs[1] > probs[2] > 0


def test_top_p_keeps_the_smallest_set_reaching_p():
    kept = keep_top_p(torch.tensor([0.5, 0.3, 0.15, 0.05]), 0.7)
    assert kept.tolist() == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0])


def test_greedy_and_seeded_sampling():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    assert TokenSampler(WorkerSampling(), torch.device("cpu"))(logits) == int(logits.argmax())
    draws = [[TokenSampler(WorkerSampling(1.0, seed=7), torch.device("cpu"))(logits) for _ in range(1)]
             for _ in range(3)]
    assert draws[0] == draws[1] == draws[2]
    sampler = TokenSampler(WorkerSampling(1.0, seed=7), torch.device("cpu"))
    assert len({sampler(logits) for _ in range(50)}) > 1  # a real draw, not argmax


@pytest.mark.parametrize("seed", [-1, -2**63, 2**63 - 1])
def test_every_signed_64_bit_seed_is_taken_and_reproducible(seed):
    logits = torch.zeros(1000)  # uniform: the draws are the generator's alone

    def draws(sample_index=0):
        sampler = TokenSampler(WorkerSampling(1.0, seed=seed), torch.device("cpu"), sample_index=sample_index)
        return [sampler(logits) for _ in range(8)]

    assert SamplingParams.from_request({"seed": seed}).seed == seed
    assert draws() == draws()
    assert draws(sample_index=1) != draws()  # the next sample, seed + 1, past either end of the range too


def test_a_tiny_temperature_acts_greedy_instead_of_overflowing():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(2)) * 30
    sampler = TokenSampler(WorkerSampling(1e-40, seed=1), torch.device("cpu"))
    assert sampler(logits) == int(logits.argmax())


@pytest.mark.parametrize("message", [
    StepTask(1, (NewRequest("r", (1, 2), WorkerSampling(0.5, 0.9, 3, 4, 5)),), ("x",)), EchoTask(2, "p"),
    ShutdownTask(), StepResult(1, StepOutput({"r": (5,)}, {"q": "boom"})), EchoResult(2, "p"), WorkerFailure(3, "boom"),
    WorkerReady(ModelInfo("m", "hf", "bfloat16", "cpu", 2048, (2,))),
])
def test_every_message_survives_pickling(message):
    assert pickle.loads(pickle.dumps(message)) == message

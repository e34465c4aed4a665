"""Log-probabilities and parallel samples in the transformers backend: the numbers are the model's own
(checked against one plain forward), prompt logprobs survive chunked prefill, forked samples equal lone ones."""
import pickle
import tracemalloc

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import EngineConfig
from engine.backends.hf import HFBackend
from engine.messages import NewRequest, PromptLogprobs, TokenLogprob, WorkerSampling

PROMPT = (1, 17, 300, 42, 9, 5000, 12, 77, 3, 8, 640)


def make_backend(model_dir: str, **settings) -> HFBackend:
    return HFBackend(EngineConfig(model=model_dir, dtype="float32", device="cpu", threads=1, **settings), model_dir)


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    return make_backend(tiny_model_dir)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """log_softmax of one uncached forward over a token sequence."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def logprobs(token_ids) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([list(token_ids)])).logits[0].float(), -1)
    return logprobs


def run(backend, requests, steps: int):
    tokens, logprobs, prompt_logprobs = {}, {}, {}
    for step in range(steps):
        output = backend.step(tuple(requests) if step == 0 else (), ())
        assert not output.failed
        for request_id, ids in output.new_token_ids.items():
            tokens.setdefault(request_id, []).extend(ids)
        for request_id, entries in output.logprobs.items():
            logprobs.setdefault(request_id, []).extend(entries)
        prompt_logprobs.update(output.prompt_logprobs)
    backend.step((), tuple(tokens))
    return tokens, logprobs, prompt_logprobs


def test_generated_logprobs_are_the_models(backend, reference):
    tokens, logprobs, _ = run(backend, [NewRequest("r", PROMPT, WorkerSampling(max_tokens=5, logprobs=3))], 5)
    expected = reference(PROMPT + tuple(tokens["r"][:-1]))[len(PROMPT) - 1:]
    assert [e.token_id for e in logprobs["r"]] == tokens["r"]
    for position, entry in enumerate(logprobs["r"]):
        assert entry.logprob == pytest.approx(expected[position, entry.token_id].item(), abs=1e-4)
        assert len(entry.top) == 3 and entry.top[0][0] == entry.token_id  # greedy: the top token
        top_values = expected[position].topk(3).values.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top_values, abs=1e-4)


@pytest.mark.parametrize("chunk", [4, 512])
def test_prompt_logprobs_across_chunks(tiny_model_dir, reference, chunk):
    backend = make_backend(tiny_model_dir, prefill_chunk_tokens=chunk)
    sampling = WorkerSampling(max_tokens=1, prompt_logprobs=2)
    _, _, prompt_logprobs = run(backend, [NewRequest("e", PROMPT, sampling)], len(PROMPT) // chunk + 2)
    entries = prompt_logprobs["e"]
    expected = reference(PROMPT)
    assert len(entries) == len(PROMPT) and entries[0] is None
    for position, entry in enumerate(entries[1:], start=1):
        assert entry.token_id == PROMPT[position]
        assert entry.logprob == pytest.approx(expected[position - 1, PROMPT[position]].item(), abs=1e-4)
        assert len(entry.top) == 2


def test_prompt_logprobs_cross_the_process_boundary_in_columns(tiny_model_dir):
    """16 echo requests of 1,500 tokens with 20 alternatives held ~4 MB each as TokenLogprob objects in both processes
    (the model worker OOM-killed in a 768 MB limit); in columns each entry costs its numbers' bytes."""
    backend = make_backend(tiny_model_dir, prefill_chunk_tokens=64)
    prompt = tuple((i * 37) % 1000 + 3 for i in range(300))
    _, _, prompt_logprobs = run(backend, [NewRequest("e", prompt, WorkerSampling(max_tokens=1, prompt_logprobs=20))], 8)
    columns = prompt_logprobs["e"]
    assert isinstance(columns, PromptLogprobs) and len(columns) == len(prompt)
    assert len(pickle.dumps(columns)) < 299 * (21 * 8 + 4) + 1000  # 4-byte ids and logprobs, and the row ends
    tracemalloc.start()
    as_objects = tuple(columns)
    held_as_objects = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert held_as_objects > 10 * len(pickle.dumps(columns))
    assert PromptLogprobs.of(as_objects) == columns and pickle.loads(pickle.dumps(columns)) == columns
    assert columns[-1] == as_objects[-1] and columns[1:3] == list(as_objects[1:3]) and columns[0] is None
    assert [entry.token_id for entry in as_objects[1:]] == list(prompt[1:])


def test_prompt_logprobs_refuse_a_gap_other_than_the_first_token():
    entry = TokenLogprob(3, -0.5, ((3, -0.5),))
    with pytest.raises(ValueError):
        PromptLogprobs.of((None, entry, None))
    with pytest.raises(ValueError):
        PromptLogprobs.of((entry,))
    assert len(PromptLogprobs.of((None,))) == 1 and list(PromptLogprobs()) == [None]
    with pytest.raises(ValueError):
        PromptLogprobs().add([3, 4], [-0.5], [[3]], [[-0.5]])
    columns = PromptLogprobs.of((None, entry))
    assert columns == (None, entry) and columns == [None, entry] and columns != (None,) and columns != "ab"


def test_forked_samples_equal_lone_requests(tiny_model_dir, backend):
    sampling = WorkerSampling(temperature=1.0, seed=11, max_tokens=8)
    group = NewRequest("g", PROMPT, sampling, sample_ids=("g#0", "g#1", "g#2"))
    tokens, _, _ = run(backend, [group, NewRequest("other", (5, 6), WorkerSampling(max_tokens=8))], 8)
    assert sorted(tokens) == ["g#0", "g#1", "g#2", "other"]
    for index in range(3):
        alone = WorkerSampling(temperature=1.0, seed=11 + index, max_tokens=8)
        lone, _, _ = run(make_backend(tiny_model_dir), [NewRequest("a", PROMPT, alone)], 8)
        assert tokens[f"g#{index}"] == lone["a"]
    assert len({tuple(t) for k, t in tokens.items() if k != "other"}) > 1  # real draws, not one copied


def test_greedy_samples_are_identical_and_one_can_finish_early(backend):
    group = NewRequest("g", PROMPT, WorkerSampling(max_tokens=6), sample_ids=("g#0", "g#1"))
    first = backend.step((group,), ())
    assert first.new_token_ids["g#0"] == first.new_token_ids["g#1"]
    assert len(backend.rows) == 2
    backend.step((), ("g#0",))  # the parent finished one sample (a stop string, say): the other goes on
    assert [row.request_id for row in backend.rows] == ["g#1"]
    backend.step((), ("g#1",))
    assert not backend.rows

"""The transformers backend's decode step copies its tokens to the host once for the whole batch (on CUDA each
`int(tensor)` per row would wait for the GPU), with greedy, seeded and failing rows side by side."""
import pytest
import torch

from engine import EngineConfig
from engine.backends.hf import HFBackend
from engine.backends.sampler import TokenSampler
from engine.messages import NewRequest, WorkerSampling

GREEDY = WorkerSampling(max_tokens=64)
SEEDED = WorkerSampling(1.0, top_p=0.9, seed=7, max_tokens=64)


class HostCopies:
    """Counts the ways a tensor's value reaches Python: tolist(), int(), item()."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("tolist", "__int__", "item"):
            monkeypatch.setattr(torch.Tensor, name, self._counted(getattr(torch.Tensor, name)))

    def _counted(self, method):
        def counted(tensor, *args):
            self.count += 1
            return method(tensor, *args)
        return counted


def make_backend(model_dir: str) -> HFBackend:
    # In this process: the conftest keeps torch single-threaded here, so later forks stay safe.
    return HFBackend(EngineConfig(model=model_dir, dtype="float32", device="cpu", threads=1), model_dir)


@pytest.fixture
def backend(tiny_model_dir):
    return make_backend(tiny_model_dir)


def decode(backend, new_requests, steps: int) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for step in range(steps):
        output = backend.step(new_requests if step == 0 else (), ())
        for request_id, ids in output.new_token_ids.items():
            tokens.setdefault(request_id, []).extend(ids)
    return tokens


def test_one_host_copy_per_decode_step_for_the_whole_batch(backend, monkeypatch):
    requests = tuple(NewRequest(f"r{i}", (1, 2, 3 + i), GREEDY if i % 2 else SEEDED) for i in range(4))
    decode(backend, requests, 1)  # prefill: each prompt's first token
    assert len(backend.rows) == 4
    copies = HostCopies(monkeypatch)
    output = backend.step((), ())
    assert copies.count == 1 and len(output.new_token_ids) == 4


def test_batched_tokens_equal_each_alone_greedy_and_seeded(tiny_model_dir, backend):
    requests = tuple(NewRequest(f"r{i}", (5, 6, 7 + i), GREEDY if i % 2 else SEEDED) for i in range(3))
    together = decode(backend, requests, 12)
    for request in requests:
        alone = decode(make_backend(tiny_model_dir), (request,), 12)
        assert alone[request.request_id] == together[request.request_id]


def test_a_row_whose_sampling_raises_fails_alone(backend, monkeypatch):
    real = TokenSampler.__call__

    def poisoned(self, logits):
        if self.sampling.seed == 13:
            raise RuntimeError("probability tensor contains nan")
        return real(self, logits)

    requests = (NewRequest("ok", (1, 2, 3), GREEDY), NewRequest("bad", (1, 2, 4), WorkerSampling(1.0, seed=13)))
    decode(backend, requests, 1)  # both in the batch
    monkeypatch.setattr(TokenSampler, "__call__", poisoned)
    output = backend.step((), ())  # a decode step: the poisoned row fails, the other gets its token
    assert list(output.failed) == ["bad"] and list(output.new_token_ids) == ["ok"]
    assert [row.request_id for row in backend.rows] == ["ok"]


def test_the_sampler_leaves_its_token_on_the_device():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    greedy = TokenSampler(WorkerSampling(), torch.device("cpu"))(logits)
    assert isinstance(greedy, torch.Tensor) and greedy.dim() == 0 and int(greedy) == int(logits.argmax())
    sampler = TokenSampler(WorkerSampling(1.0, seed=7), torch.device("cpu"))
    assert len({int(sampler(logits)) for _ in range(50)}) > 1  # a real draw, not argmax

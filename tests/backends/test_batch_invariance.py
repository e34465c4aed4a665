"""Greedy is greedy: with the real model, in bfloat16 and on its 4-bit blocks, a request's tokens are the ones it
gets alone, whatever else the batch holds (requests joining and leaving, a long prompt prefilling beside the
streams)."""
import pytest
import torch

from engine import SamplingParams
from engine.backends.hf import HFBackend
from engine.backends.sampler import TokenSampler
from engine.config import EngineConfig
from engine.messages import NewRequest, WorkerSampling

TOPICS = ["the ocean", "a small robot", "tax law", "bread", "the moon landing", "chess openings", "volcanoes",
          "a lighthouse keeper", "prime numbers", "jazz"]
PROMPTS = [f"Write a short paragraph about {topic}." for topic in TOPICS]


COMPUTE = {"bfloat16": {"dtype": "bfloat16"}, "4-bit": {"weights": "q4"}, "4-bit exact": {"weights": "exact"}}


@pytest.mark.parametrize("compute", COMPUTE)
def test_concurrent_greedy_answers_equal_each_alone(make_engine, smol_model_dir, compute):
    engine = make_engine(smol_model_dir, max_batch_size=16, prefill_chunk_tokens=64, **COMPUTE[compute])
    long_prompt = "Summarise this: " + " ".join(f"item {i} is {TOPICS[i % len(TOPICS)]};" for i in range(60))
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    alone = {p: engine.generate([p], greedy)[0].output_token_ids for p in [*PROMPTS, long_prompt]}
    first = [engine.submit(p, greedy) for p in PROMPTS[:5]]
    next(iter(first[0]))  # the rest join a running batch, the long prompt prefills in chunks beside it
    later = [engine.submit(p, SamplingParams(max_tokens=20 - 3 * i, ignore_eos=True))  # leaving at different steps
             for i, p in enumerate(PROMPTS[5:])]
    long_request = engine.submit(long_prompt, greedy)
    together = {p: h.result(timeout=600).output_token_ids for p, h in zip(PROMPTS, first + later)}
    together[long_prompt] = long_request.result(timeout=600).output_token_ids
    differing = [p for p in together if together[p] != alone[p][:len(together[p])]]
    assert differing == []


@pytest.mark.parametrize("compute", COMPUTE)
def test_a_lone_row_decodes_the_same_logits_as_inside_a_batch(smol_model_dir, monkeypatch, compute):
    """oneDNN's bfloat16 matmul rounds a one-row batch differently: a lone row is padded to two. The 4-bit
    kernels compute every row alike, alone too."""
    logits_seen: dict[int, list[torch.Tensor]] = {}
    real = TokenSampler.__call__

    def recording(self, logits):
        logits_seen.setdefault(self.sampling.seed, []).append(logits.clone())
        return real(self, logits)

    monkeypatch.setattr(TokenSampler, "__call__", recording)
    # logprobs: the rows go through their samplers (plain greedy rows share one argmax and never call them).
    requests = [NewRequest(f"r{i}", tuple(range(100 + 37 * i, 130 + 41 * i)),
                           WorkerSampling(seed=i, max_tokens=99, logprobs=0)) for i in range(4)]

    def decode(batch: list[NewRequest], steps: int) -> None:
        backend = HFBackend(EngineConfig(model=smol_model_dir, device="cpu", threads=1, **COMPUTE[compute]),
                            smol_model_dir)
        for step in range(steps):
            backend.step(tuple(batch) if step == 0 else (), ())

    decode(requests, 12)
    together = {seed: logits_seen.pop(seed) for seed in range(4)}  # a prompt may join a step late: fewer
    for request in requests:
        decode([request], 12)
        alone = logits_seen.pop(request.sampling.seed)
        assert len(alone) == 12 and len(together[request.sampling.seed]) >= 8
        assert all(torch.equal(a, b) for a, b in zip(alone, together[request.sampling.seed]))


def test_a_burst_of_new_prompts_goes_in_one_pass_and_a_failed_pass_fails_no_one(smol_model_dir, monkeypatch):
    """New requests of one step are prefilled in one pass over the 4-bit weights (not one pass each), with each
    one's tokens as alone; a prompt that had a prefix-cache hit joins from where its hit ends. Should the pass
    fail (a fault injected once), every prompt is fed alone and answers: the failure loses no one."""
    config = EngineConfig(model=smol_model_dir, device="cpu", threads=1, weights="q4")
    prompts = [tuple(range(100 + 37 * i, 130 + 41 * i)) for i in range(5)]

    def first_steps(backend, requests, steps=3):
        """The requests' tokens of their first steps, and their failures; then they are finished."""
        tokens, failed = {}, {}
        for step in range(steps):
            output = backend.step(tuple(requests) if step == 0 else (), ())
            failed.update(output.failed)
            for request_id, new in output.new_token_ids.items():
                tokens.setdefault(request_id, []).extend(new)
        backend.step((), tuple(request.request_id for request in requests))
        return tokens, failed

    def requests(tag):
        return [NewRequest(f"{tag}{i}", prompt, WorkerSampling(max_tokens=3)) for i, prompt in enumerate(prompts)]

    alone = {}
    for request in requests("r"):
        backend = HFBackend(config, smol_model_dir)
        alone[request.request_id] = first_steps(backend, [request])[0][request.request_id]
        backend.close()
    backend = HFBackend(config, smol_model_dir)
    passes, real = [], backend.fast_decoder.prefill_many
    monkeypatch.setattr(backend.fast_decoder, "prefill_many",
                        lambda chunks: passes.append([(len(ids), start) for ids, start, _ in chunks]) or real(chunks))
    tokens, failed = first_steps(backend, requests("r"))
    assert passes == [[(len(prompt), 0) for prompt in sorted(prompts, key=len)]]  # fewest tokens first
    assert failed == {} and tokens == alone
    # again, after a step in which the same prompts' 32-token blocks went into the prefix cache
    passes.clear()
    tokens, failed = first_steps(backend, requests("again-r"))
    assert sorted(start for _, start in passes[0]) == sorted(len(p) // 32 * 32 for p in prompts) and failed == {}
    assert {f"again-{request_id}": t for request_id, t in alone.items()} == tokens

    def failing_once(chunks):
        monkeypatch.setattr(backend.fast_decoder, "prefill_many", real)
        raise MemoryError("injected: no memory for the pass")

    monkeypatch.setattr(backend.fast_decoder, "prefill_many", failing_once)
    tokens, failed = first_steps(backend, requests("after-failure-r"))
    assert failed == {} and {f"after-failure-{request_id}": t for request_id, t in alone.items()} == tokens
    backend.close()

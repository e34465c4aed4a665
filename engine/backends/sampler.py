"""Logits -> token, one small step at a time (temperature, top-k, top-p, a seeded draw)."""
import random

import torch

from ..messages import WorkerSampling


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    # logits: [V] float32. Shifting the max to 0 first keeps a tiny temperature from overflowing to inf/NaN.
    logits = (logits - logits.max()) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        probs = keep_top_p(probs, top_p)
    return probs


def keep_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    outside = mass_before >= top_p
    outside[0] = False  # the top token always stays, even for a top_p that rounds to 0 in float32
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum()


class TokenSampler:
    """Per-request sampling state: greedy, or a draw from its own seeded generator (reproducible)."""

    def __init__(self, sampling: WorkerSampling, device: torch.device):
        self.sampling = sampling
        self.generator = None
        if sampling.temperature > 0:
            seed = sampling.seed if sampling.seed is not None else random.getrandbits(63)
            self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token id as a 0-d tensor on the logits' device. No `int()` here: on CUDA that would wait
        for the GPU once per row; the caller copies a whole batch's tokens to the host at once."""
        logits = logits.float()
        if self.generator is None:
            return torch.argmax(logits)
        s = self.sampling
        probs = logits_to_probs(logits, s.temperature, s.top_k, s.top_p)
        return torch.multinomial(probs, 1, generator=self.generator)[0]

"""Logits -> token, one small step at a time: the request's mask, logits processors (vLLM's order and
semantics), temperature, top-k, top-p, a seeded draw; and the log-probabilities the request asked for.

Log-probabilities are those of the model's own distribution: log_softmax of the raw logits, before any
processor, bias or temperature. That is vLLM's default (`logprobs_mode="raw_logprobs"`), so both backends
report the same numbers, and a score does not move with the sampling settings (what evaluation harnesses
need). The functions take `[..., V]` logits, so a backend that samples a whole batch can call them batched.
"""
import random

import torch

from ..messages import NewRequest, PromptLogprobs, TokenLogprob, WorkerSampling
from .constrained import GrammarCompiler, constraint_for

NUCLEUS_CANDIDATES = 256  # on CPU, top_p first looks for the nucleus among this many most likely tokens


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
    # On CPU a full sort of the vocabulary is the costliest part of sampling a token (docs/benchmarks.md), and the
    # nucleus nearly always lies among the first few hundred tokens: when it does, it is exactly the same set (the
    # same tensor comes out).
    # On a GPU the sort is cheap and the check would wait for the device, so it always sorts.
    if probs.device.type == "cpu" and probs.shape[-1] > NUCLEUS_CANDIDATES:
        top_probs, top_ids = torch.topk(probs, NUCLEUS_CANDIDATES)
        if float(torch.cumsum(top_probs, dim=-1)[-1]) >= top_p:  # the next token would be outside
            return _nucleus(probs, top_probs, top_ids, top_p)
    sorted_probs, order = torch.sort(probs, descending=True)
    return _nucleus(probs, sorted_probs, order, top_p)


def _nucleus(probs: torch.Tensor, sorted_probs: torch.Tensor, order: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the most likely tokens until their mass reaches top_p. sorted_probs: the largest, descending."""
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    outside = mass_before >= top_p
    outside[0] = False  # the top token always stays, even for a top_p that rounds to 0 in float32
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum()


# -- logits processors (vLLM semantics) ---------------------------------------------------------------------


def apply_logit_bias(logits: torch.Tensor, token_ids: torch.Tensor, biases: torch.Tensor) -> torch.Tensor:
    # logits: [..., V]; token_ids, biases: [N]
    return logits.index_add(-1, token_ids, biases.expand(*logits.shape[:-1], -1))


def mask_tokens(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """min_tokens: these tokens cannot be drawn."""
    return logits.index_fill(-1, token_ids, float("-inf"))


def apply_penalties(logits: torch.Tensor, seen_ids: torch.Tensor, output_ids: torch.Tensor,
                    output_counts: torch.Tensor, repetition: float, frequency: float, presence: float) -> torch.Tensor:
    """vLLM's penalties on one row [V], touching only the tokens concerned (a dense pass over V would cost more
    than the rest of a token's sampling on CPU: docs/benchmarks.md). seen_ids: [S] the distinct tokens of the prompt
    and the output (repetition: a positive logit is divided by the penalty, a negative one multiplied); output_ids, output_counts: [O] each generated
    token and how often (frequency subtracts per occurrence, presence once)."""
    if repetition != 1.0 and len(seen_ids):
        values = logits[seen_ids]
        logits = logits.index_copy(0, seen_ids, torch.where(values > 0, values / repetition, values * repetition))
    if frequency and len(output_ids):
        logits = logits.index_add(0, output_ids, output_counts, alpha=-frequency)
    if presence and len(output_ids):
        logits = logits.index_add(0, output_ids, torch.ones_like(output_counts), alpha=-presence)
    return logits


# -- log-probabilities -------------------------------------------------------------------------------------


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """(logprob of each token, top-k logprobs, top-k ids), on the device. logits: [P, V]; token_ids: [P]."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)  # [P]
    top = torch.topk(logprobs, k, dim=-1) if k else None
    return chosen, *(top if top else (logprobs.new_empty((len(token_ids), 0)),
                                      token_ids.new_empty((len(token_ids), 0))))


def to_entries(token_ids: list[int], chosen: list[float], top_values: list[list[float]],
               top_ids: list[list[int]]) -> list[TokenLogprob]:
    return [TokenLogprob(token_id, logprob, tuple(zip(ids, values)))
            for token_id, logprob, values, ids in zip(token_ids, chosen, top_values, top_ids)]


def add_prompt_logprobs(columns: PromptLogprobs, logits: torch.Tensor, next_token_ids: list[int], k: int) -> None:
    """The logprob of each prompt token given those before it, into `columns`. logits: [C, V] of positions whose
    next tokens are `next_token_ids` (C or C - 1 of them: the last position of a prompt predicts no prompt token)."""
    num = len(next_token_ids)
    if num == 0:
        return
    targets = torch.tensor(next_token_ids, device=logits.device)
    chosen, values, ids = token_logprobs(logits[:num], targets, k)
    columns.add(next_token_ids, chosen.tolist(), ids.tolist(), values.tolist())


# -- one request's sampler -----------------------------------------------------------------------------------


class TokenSampler:
    """Per-sample state: its processors' state (tokens seen, counts), a seeded generator (reproducible), and
    the logprob entry of its last token.

    The backend calls `sampler(logits)` for the next token (left on the device), then `accept(token_id)` once
    the token reached the host: that advances the state and returns the token's TokenLogprob (or None).
    """

    def __init__(self, sampling: WorkerSampling, device: torch.device, prompt_token_ids: tuple[int, ...] = (),
                 sample_index: int = 0, vocab_size: int | None = None, grammars: GrammarCompiler | None = None):
        self.sampling = sampling
        self.constraint = constraint_for(sampling, grammars)  # JSON mode or tool calls, else None
        self.device = device
        self.num_generated = 0
        self.generator = None
        if sampling.temperature > 0:
            # Samples of one request: seed, seed + 1, ... as vLLM's parallel sampling does.
            seed = sampling.seed + sample_index if sampling.seed is not None else random.getrandbits(63)
            self.generator = torch.Generator(device=device).manual_seed(seed % 2**63)
        self._pending: tuple[torch.Tensor, ...] | None = None
        self._state = ProcessorState(sampling, device, prompt_token_ids, vocab_size) \
            if sampling.has_processors else None

    @property
    def wants_logprobs(self) -> bool:
        return self.sampling.logprobs is not None

    @property
    def is_plain_greedy(self) -> bool:
        """argmax of the raw logits is this sampler's whole job (no draw, mask, processor or logprobs): a
        backend may then pick the token for a whole batch at once without calling it (and then skip `accept`)."""
        return self.generator is None and self.constraint is None and self._state is None \
            and not self.wants_logprobs

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """The next token id as a 0-d tensor on the logits' device. No `int()` here: on CUDA that would wait
        for the GPU once per row; the caller copies a whole batch's tokens to the host at once."""
        raw = logits.float()
        logits = self.mask(raw)
        if self._state is not None:
            logits = self._state.process(logits, self.num_generated)
        token = self._draw(logits)
        if self.wants_logprobs:
            self._pending = token_logprobs(raw.unsqueeze(0), token.reshape(1), self.sampling.logprobs)
        return token

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """The request's own logits mask, applied before the processors (structured output hooks in here)."""
        return logits if self.constraint is None else self.constraint.mask(logits)

    def accept(self, token_id: int) -> TokenLogprob | None:
        """The token reached the host and is the request's now: advance the state; its logprob entry."""
        self.num_generated += 1
        if self.constraint is not None:
            self.constraint.advance(token_id)
        if self._state is not None:
            self._state.add_output_token(token_id)
        if self._pending is None:
            return None
        chosen, values, ids = self._pending
        self._pending = None
        return to_entries([token_id], chosen.tolist(), values.tolist(), ids.tolist())[0]

    def _draw(self, logits: torch.Tensor) -> torch.Tensor:
        if self.generator is None:
            return torch.argmax(logits)
        s = self.sampling
        probs = logits_to_probs(logits, s.temperature, s.top_k, s.top_p)
        return torch.multinomial(probs, 1, generator=self.generator)[0]


class ProcessorState:
    """What the processors remember of one sample: the distinct tokens seen (prompt and output) and how often
    each was generated; kept on the host (the tokens come back there) and sent as small index tensors."""

    def __init__(self, sampling: WorkerSampling, device: torch.device, prompt_token_ids: tuple[int, ...],
                 vocab_size: int | None):
        self.sampling = sampling
        self.device = device
        self.vocab_size = vocab_size
        self.seen: dict[int, None] = dict.fromkeys(prompt_token_ids)  # distinct, in order
        self.output_counts: dict[int, int] = {}
        self.bias_ids = torch.tensor([i for i, _ in sampling.logit_bias], dtype=torch.long, device=device)
        self.bias_values = torch.tensor([b for _, b in sampling.logit_bias], dtype=torch.float32, device=device)
        self.stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=device)
        self._tensors: tuple[torch.Tensor, ...] | None = None  # (seen ids, output ids, counts), until a new token

    @property
    def has_penalties(self) -> bool:
        s = self.sampling
        return bool(s.presence_penalty or s.frequency_penalty or s.repetition_penalty != 1.0)

    def process(self, logits: torch.Tensor, num_generated: int) -> torch.Tensor:
        """vLLM v1's order: min_tokens and logit_bias, then the penalties."""
        s = self.sampling
        if num_generated < s.min_tokens and len(self.stop_ids):
            logits = mask_tokens(logits, self.stop_ids)
        if len(self.bias_ids):
            logits = apply_logit_bias(logits, self.bias_ids, self.bias_values)
        if self.has_penalties:
            logits = apply_penalties(logits, *self._penalty_tensors(), s.repetition_penalty, s.frequency_penalty,
                                     s.presence_penalty)
        return logits

    def add_output_token(self, token_id: int) -> None:
        if self.has_penalties:
            self.seen[token_id] = None
            self.output_counts[token_id] = self.output_counts.get(token_id, 0) + 1
            self._tensors = None

    def _penalty_tensors(self) -> tuple[torch.Tensor, ...]:
        if self._tensors is None:
            self._tensors = (torch.tensor(list(self.seen), dtype=torch.long, device=self.device),
                             torch.tensor(list(self.output_counts), dtype=torch.long, device=self.device),
                             torch.tensor(list(self.output_counts.values()), dtype=torch.float32, device=self.device))
        return self._tensors


def samplers_for(request: NewRequest, device: torch.device, vocab_size: int | None = None,
                 grammars: GrammarCompiler | None = None) -> list[TokenSampler]:
    """One sampler per sample of the request (n > 1 and best_of fork from one prefill)."""
    return [TokenSampler(request.sampling, device, request.prompt_token_ids, index, vocab_size, grammars)
            for index in range(len(request.all_sample_ids))]

"""JSON mode in the worker: a matcher per request, from the model's vocabulary, that masks the request's logits.

The schema arrives checked, as JSON text (engine/response_format.py). `GrammarCompiler` loads the model's vocabulary
once, on the first constrained request, and builds a `JsonConstraint` per request. A request's sampler masks its
logits with the allowed tokens and advances the matcher with each accepted token; once the JSON is complete only EOS
is allowed, so the request ends there with finish_reason "stop". The library is llguidance: the one vLLM's guidance
backend uses, so one install serves both backends (docs/benchmarks.md, "JSON mode", for why not xgrammar or
outlines-core).
"""
import logging
from collections import OrderedDict

from ..response_format import MAX_EXPANSION, NUM_KEPT_SCHEMAS, expansion_of, grammar_of, parser_limits, short_error

logger = logging.getLogger(__name__)

# Kept matchers are bounded by their total expansion too: 32 schemas at the bound would hold ~500 MB.
MAX_KEPT_EXPANSION = 2 * MAX_EXPANSION
# A tool grammar's weight among the kept matchers: its schemas passed the same bounds, but they are not walked here.
LARK_WEIGHT = MAX_EXPANSION // 4


def constraint_for(sampling, grammars: "GrammarCompiler | None") -> "JsonConstraint | None":
    """The sampler's hook: a matcher when the request is in JSON mode or must call tools, else None."""
    if sampling.json_schema is not None:
        kind, text = "json", sampling.json_schema
    elif sampling.lark_grammar is not None:
        kind, text = "lark", sampling.lark_grammar
    else:
        return None
    if grammars is None:
        raise ValueError("response_format: this backend has no grammar compiler")
    return grammars.constraint(kind, text)


class GrammarCompiler:
    """One per worker (the backend holds it): the model's vocabulary as llguidance needs it, loaded on the
    first constrained request (it takes a while: not at start), then a matcher per request."""

    def __init__(self, model_path: str, vocab_size: int | None, eos_token_ids: tuple[int, ...]):
        self.model_path = model_path
        self.vocab_size = vocab_size  # the width of the logits; None: the tokenizer's size
        self.eos_token_ids = eos_token_ids
        self._tokenizer = None
        # (kind, grammar text) -> (matcher, weight)
        self._fresh_matchers: OrderedDict[tuple[str, str], tuple[object, int]] = OrderedDict()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer

    def constraint(self, kind: str, text: str) -> "JsonConstraint":
        """A fresh matcher for one request (one per sample: n > 1 samples advance apart). `kind`: "json" (a
        checked schema) or "lark" (tool calls: their markup around the tools' checked schemas)."""
        key = (kind, text)
        kept = self._fresh_matchers.get(key)
        if kept is None:
            weight = expansion_of(text) if kind == "json" else LARK_WEIGHT
            kept = self._build_matcher(kind, text), weight
            self._fresh_matchers[key] = kept
        self._fresh_matchers.move_to_end(key)
        self._forget_oldest_matchers()
        return JsonConstraint(kept[0].deep_copy(), self.tokenizer.vocab_size)

    def _forget_oldest_matchers(self) -> None:
        """At most NUM_KEPT_SCHEMAS kept, of MAX_KEPT_EXPANSION in all (a large matcher holds ~10 MB)."""
        while len(self._fresh_matchers) > 1 and (
                len(self._fresh_matchers) > NUM_KEPT_SCHEMAS
                or sum(weight for _, weight in self._fresh_matchers.values()) > MAX_KEPT_EXPANSION):
            self._fresh_matchers.popitem(last=False)

    def _build_matcher(self, kind: str, text: str):
        from llguidance import LLMatcher

        matcher = LLMatcher(self.tokenizer, grammar_of(kind, text), log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise ValueError(f"response_format: {short_error(matcher.get_error())[:300]}")
        return matcher

    def _load_tokenizer(self):
        import llguidance.hf
        from transformers import AutoTokenizer

        hf_tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        eos = set(self.eos_token_ids) | ({hf_tokenizer.eos_token_id} - {None})
        vocab_size = max(self.vocab_size or 0, len(hf_tokenizer))
        logger.info("JSON mode: loading the vocabulary of %s (%d tokens, EOS %s)", self.model_path, vocab_size,
                    sorted(eos))
        return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(eos))


class JsonConstraint:
    """One request's matcher: `mask(logits)` before its token is drawn, `advance(token_id)` after.

    `advance` never raises (the backend calls it outside its per-request error handling); a token the
    grammar refuses leaves the matcher in its error state, and the next `mask` raises ValueError, which
    fails this request alone."""

    def __init__(self, matcher, vocab_size: int):
        import numpy as np

        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bitmask = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)  # bit i: token i allowed

    def mask(self, logits):
        """`logits` [V] with every token the grammar does not allow next set to -inf."""
        import numpy as np
        import torch
        from llguidance.numpy import fill_next_token_bitmask

        if self.matcher.is_error():
            raise ValueError(f"response_format: {short_error(self.matcher.get_error())[:300]}")
        fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        allowed = np.unpackbits(self.bitmask[0].view(np.uint8), bitorder="little")  # [32 * words]
        width = logits.shape[-1]
        if width > allowed.shape[0]:  # logits wider than the vocabulary: padding columns are never allowed
            allowed = np.pad(allowed, (0, width - allowed.shape[0]))
        is_blocked = torch.from_numpy(allowed[:width] == 0).to(logits.device, non_blocking=True)
        return logits.masked_fill(is_blocked, float("-inf"))

    def advance(self, token_id: int) -> None:
        if not self.matcher.is_stopped():
            self.matcher.consume_token(token_id)  # False puts the matcher in its error state: see `mask`

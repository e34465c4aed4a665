"""Hugging Face transformers backend: a KV-cached, left-padded batch that requests join and leave.

The batch keeps one DynamicCache whose rows are the running requests, left-padded to a
common length with an attention mask that hides the padding; each row carries its own
position ids, so a short prompt batched with a long one computes exactly what it would
alone. A step frees finished rows, decodes one token for every running row (one forward)
and prefills the new requests (one forward), then merges their cache rows into the batch.
"""
import inspect
import logging
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from ..config import EngineConfig
from ..messages import ModelInfo, NewRequest
from .base import Backend, resolve_device
from .sampler import TokenSampler

logger = logging.getLogger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "auto": torch.bfloat16}
DEFAULT_CONTEXT = 2048


@dataclass
class Row:
    request_id: str
    sampler: TokenSampler
    num_tokens: int  # tokens in the cache = position id of the next input token
    last_token_id: int


class HFBackend(Backend):
    def __init__(self, config: EngineConfig, model_path: str):
        torch.set_num_threads(config.num_threads)
        self.device = torch.device(resolve_device(config.device))
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[config.dtype])
        self.model.to(self.device).eval()
        self.accepts_logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.rows: list[Row] = []
        self.cache: DynamicCache | None = None
        self.attention_mask: torch.Tensor | None = None  # [B, T]
        self.info = ModelInfo(
            model=model_path, backend="hf", dtype=str(self.model.dtype).removeprefix("torch."),
            device=str(self.device), max_model_len=_context_length(self.model.config, config.max_model_len),
            eos_token_ids=_eos_token_ids(self.model))
        logger.info("transformers backend: %s on %s, %d threads", self.info.dtype, self.device,
                    torch.get_num_threads())

    @torch.inference_mode()
    def step(self, new_requests: tuple[NewRequest, ...], finished_ids: tuple[str, ...]) -> dict:
        self._free(set(finished_ids))
        new_token_ids = self._decode() if self.rows else {}
        if new_requests:
            new_token_ids.update(self._prefill(new_requests))
        return new_token_ids

    def close(self) -> None:
        self._free({row.request_id for row in self.rows})

    def _decode(self) -> dict[str, tuple[int]]:
        input_ids = torch.tensor([[row.last_token_id] for row in self.rows], device=self.device)  # [B, 1]
        position_ids = torch.tensor([[row.num_tokens] for row in self.rows], device=self.device)  # [B, 1]
        ones = torch.ones_like(input_ids)
        self.attention_mask = torch.cat([self.attention_mask, ones], dim=1)  # [B, T+1]
        logits = self._forward(input_ids, self.attention_mask, position_ids, self.cache)  # [B, V]
        for row in self.rows:
            row.num_tokens += 1  # the token just fed is in the cache now
        return {row.request_id: (self._sample(row, logits[i]),) for i, row in enumerate(self.rows)}

    def _prefill(self, requests: tuple[NewRequest, ...]) -> dict[str, tuple[int]]:
        input_ids, attention_mask = self._left_pad([r.prompt_token_ids for r in requests])  # [N, S]
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache()
        logits = self._forward(input_ids, attention_mask, position_ids, cache)  # [N, V]
        rows = [Row(r.request_id, TokenSampler(r.sampling, self.device), len(r.prompt_token_ids), 0)
                for r in requests]
        new_token_ids = {row.request_id: (self._sample(row, logits[i]),) for i, row in enumerate(rows)}
        self._merge(rows, cache, attention_mask)
        return new_token_ids

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        extra = {"logits_to_keep": 1} if self.accepts_logits_to_keep else {}
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, **extra)
        return out.logits[:, -1, :]

    @staticmethod
    def _sample(row: Row, logits: torch.Tensor) -> int:
        """Pick the row's next token; the next decode feeds it at position `row.num_tokens`."""
        row.last_token_id = row.sampler(logits)
        return row.last_token_id

    def _left_pad(self, prompts: list[tuple[int, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        length = max(len(p) for p in prompts)
        input_ids = torch.zeros((len(prompts), length), dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), length), dtype=torch.long)
        for i, prompt in enumerate(prompts):
            input_ids[i, length - len(prompt):] = torch.tensor(prompt)
            attention_mask[i, length - len(prompt):] = 1
        return input_ids.to(self.device), attention_mask.to(self.device)

    def _merge(self, rows: list[Row], cache: DynamicCache, attention_mask: torch.Tensor) -> None:
        """Append freshly prefilled rows to the batch, left-padding whichever side is shorter."""
        if not self.rows:
            self.rows, self.cache, self.attention_mask = rows, cache, attention_mask
            return
        length = max(self.attention_mask.shape[1], attention_mask.shape[1])
        layers = [
            (torch.cat([_pad_left(k1, length, 2), _pad_left(k2, length, 2)]),
             torch.cat([_pad_left(v1, length, 2), _pad_left(v2, length, 2)]))
            for (k1, v1), (k2, v2) in zip(_kv(self.cache), _kv(cache))
        ]
        self.cache = DynamicCache(ddp_cache_data=layers)
        self.attention_mask = torch.cat([_pad_left(self.attention_mask, length, 1),
                                         _pad_left(attention_mask, length, 1)])
        self.rows = self.rows + rows

    def _free(self, finished_ids: set[str]) -> None:
        keep = [i for i, row in enumerate(self.rows) if row.request_id not in finished_ids]
        if len(keep) == len(self.rows):
            return
        if not keep:
            self.rows, self.cache, self.attention_mask = [], None, None
            return
        # Drop the leading columns that are padding in every remaining row.
        mask = self.attention_mask[keep]
        start = int((mask.sum(dim=0) == 0).long().cumprod(dim=0).sum())
        index = torch.tensor(keep, device=self.device)
        self.cache = DynamicCache(ddp_cache_data=[(k[index, :, start:], v[index, :, start:])
                                                  for k, v in _kv(self.cache)])
        self.attention_mask = mask[:, start:]
        self.rows = [self.rows[i] for i in keep]


def _kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def _pad_left(tensor: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - tensor.shape[dim]
    if missing == 0:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = missing
    return torch.cat([tensor.new_zeros(shape), tensor], dim=dim)


def _context_length(model_config, configured: int) -> int:
    native = getattr(model_config, "max_position_embeddings", None) or DEFAULT_CONTEXT
    return min(configured, native) if configured else native


def _eos_token_ids(model) -> tuple[int, ...]:
    ids = set()
    for source in (model.config, model.generation_config):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return tuple(sorted(ids))

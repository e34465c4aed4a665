"""A checked GGUF written as a Hugging Face model folder: the config from the file's hyperparameters, the weights
dequantized tensor by tensor from the file in place (gguf-py's dequantization, float32: every block type's values
exactly), and the tokenizer from its metadata by transformers' own GGUF tokenizer builders.

Tensors are named and ordered as llama.cpp's convert_hf_to_gguf.py wrote them, undone here: `llama` q/k rows
un-permuted (llama.cpp interleaves the rotary halves of each head), Gemma's norms stored as 1 + w. Reading the
metadata with engine/gguf_file.py rather than through transformers' GGUF loaders takes a fifth of a second where
each of those parses the whole vocabulary again (about 8 s per call for a 49,152-token one on 2 cores), and no model
is ever built here: the folder is written as shards, so memory holds one shard (not the model twice).
No torch: this runs in the preparing child (engine/prepare_model.py).
"""
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .gguf_file import GGUFFile, Hyperparameters, InvalidGGUF, hyperparameters

logger = logging.getLogger(__name__)

CONFIG_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                  "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
                  "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM")}
GEMMA3_27B_WIDTH = 5376  # llama.cpp scales Gemma 3 27B's attention by 1/sqrt(hidden / heads), the rest by head size
# Llama 3.1+ files carry the rotary frequencies' factors as a tensor (rope_freqs.weight); transformers computes
# them from these parameters, with the largest factor as `factor` (checked against the tensor).
LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SHARD_BYTES = 2 << 30
# A folder keeps the file's weights in float32 up to this size (what vLLM and the model's own forward load, and the
# tests' reference models); a bigger file's are never written out (a 7 B file would take 28 GB of disk and of
# memory): every path reads them from the file itself (engine/backends/gguf_weights.py).
FOLDER_WEIGHTS_MAX_BYTES = 2 << 30
# Tokens that end a turn in the families lockstep serves (besides the file's own EOS): a chat answer stops there.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>")
LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "post_ffw_norm": "post_feedforward_layernorm"}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


def write_folder(gguf: GGUFFile, target: Path, weights: bool | None = None) -> bool:
    """Config, generation config, tokenizer and (`weights`; None: where they fit FOLDER_WEIGHTS_MAX_BYTES) the
    float32 weights of `gguf` into `target` (a new folder). Returns whether the weights were written."""
    hp = hyperparameters(gguf)
    if weights is None:
        weights = float32_bytes(gguf) <= FOLDER_WEIGHTS_MAX_BYTES
    tokenizer = build_tokenizer(gguf)
    config = hf_config(gguf, hp)
    target.mkdir(parents=True)
    config.save_pretrained(target)
    generation_config(config, tokenizer, gguf).save_pretrained(target)
    tokenizer.save_pretrained(target)
    if weights:
        _write_weights(gguf, hp, target)
    return weights


def float32_bytes(gguf: GGUFFile) -> int:
    """The file's weights in float32."""
    return 4 * sum(int(np.prod(tensor.shape, dtype=np.int64)) for tensor in gguf.tensors.values())


def hf_config(gguf: GGUFFile, hp: Hyperparameters):
    import transformers

    arch, metadata = hp.architecture, gguf.metadata
    config_class, model_class = CONFIG_CLASSES[arch]
    settings = dict(
        architectures=[model_class], vocab_size=hp.vocab_size, hidden_size=hp.hidden_size,
        intermediate_size=hp.intermediate_size, num_hidden_layers=hp.num_layers, num_attention_heads=hp.num_heads,
        num_key_value_heads=hp.num_kv_heads, head_dim=hp.head_dim, max_position_embeddings=hp.context_length,
        rms_norm_eps=_number(metadata, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=_number(metadata, f"{arch}.rope.freq_base", 10000.0),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        **{name: metadata.get(f"tokenizer.ggml.{key}") for name, key in (
            ("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("pad_token_id", "padding_token_id"))})
    rope_scaling = _rope_scaling(gguf, hp)
    if rope_scaling:
        settings["rope_scaling"] = rope_scaling
    if arch == "gemma3":
        settings["sliding_window"] = int(metadata.get("gemma3.attention.sliding_window", 4096))
        settings["query_pre_attn_scalar"] = hp.hidden_size // hp.num_heads \
            if hp.hidden_size == GEMMA3_27B_WIDTH else hp.head_dim
    return getattr(transformers, config_class)(**settings)


def _number(metadata: dict, key: str, default: float) -> float:
    value = metadata.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not np.isfinite(value) or value <= 0:
        raise InvalidGGUF(f"{key} is {value!r} (expected a positive number)")
    return float(value)


def _rope_scaling(gguf: GGUFFile, hp: Hyperparameters) -> dict | None:
    """Linear scaling (Gemma 3 4 B and up) from the metadata; Llama 3's from its rope_freqs tensor, checked."""
    kind = gguf.metadata.get(f"{hp.architecture}.rope.scaling.type", "none")
    if kind == "linear":
        return {"rope_type": "linear", "factor": _number(gguf.metadata, f"{hp.architecture}.rope.scaling.factor", 1.0)}
    if kind not in ("none", "", None):
        raise InvalidGGUF(f"{gguf.path}: rotary scaling {kind!r} (lockstep reads none, linear and Llama 3's)")
    if "rope_freqs.weight" not in gguf.tensors:
        return None
    factors = _dequantized(gguf, "rope_freqs.weight").reshape(-1)
    scaling = dict(LLAMA3_ROPE, factor=float(factors.max()))
    if factors.shape[0] != hp.head_dim // 2 or not np.allclose(factors, _llama3_factors(scaling, hp, gguf),
                                                                rtol=1e-3):
        raise InvalidGGUF(f"{gguf.path}: rope_freqs.weight holds factors other than Llama 3's rotary scaling")
    return scaling


def _llama3_factors(scaling: dict, hp: Hyperparameters, gguf: GGUFFile) -> np.ndarray:
    """The factor each rotary frequency is divided by under Llama 3's scaling (what llama.cpp's converter stores)."""
    base = _number(gguf.metadata, f"{hp.architecture}.rope.freq_base", 10000.0)
    wavelengths = 2 * np.pi * base ** (np.arange(0, hp.head_dim, 2, dtype=np.float64) / hp.head_dim)
    low, high = (scaling["original_max_position_embeddings"] / scaling[key]
                 for key in ("low_freq_factor", "high_freq_factor"))
    smooth = (scaling["original_max_position_embeddings"] / wavelengths - scaling["low_freq_factor"]) / \
        (scaling["high_freq_factor"] - scaling["low_freq_factor"])
    blended = 1 / ((1 - smooth) / scaling["factor"] + smooth)
    return np.where(wavelengths < high, 1.0, np.where(wavelengths > low, scaling["factor"], blended))


def build_tokenizer(gguf: GGUFFile):
    """transformers' tokenizer for the file's vocabulary (BPE or SentencePiece, its pre-tokenizer, its special
    tokens), with the file's chat template, and a BOS added where the file says so."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    metadata = gguf.metadata
    grouped = {group: {name: _plain(metadata[f"tokenizer.{key}"]) for key, name in renames.items()
                       if f"tokenizer.{key}" in metadata}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokens, settings = grouped["tokenizer"]["tokens"], dict(grouped["tokenizer_config"])
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        index = metadata.get(f"tokenizer.ggml.{key}")
        settings[name] = tokens[index] if isinstance(index, int) and 0 <= index < len(tokens) else None
    try:
        backend, _ = convert_gguf_tokenizer(gguf.architecture, grouped["tokenizer"])
    except (ValueError, KeyError) as exc:
        raise InvalidGGUF(f"{gguf.path}: its tokenizer cannot be built ({exc})") from exc
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **settings)
    _add_bos_as_the_file_says(tokenizer, gguf)
    return tokenizer


def _plain(value):
    return value.tolist() if isinstance(value, np.ndarray) else value


def _add_bos_as_the_file_says(tokenizer, gguf: GGUFFile) -> None:
    """`tokenizer.ggml.add_bos_token` (Gemma's and Llama 3's files say true): transformers' GGUF tokenizer does not
    add the BOS by itself, so a plain prompt would reach the model without it."""
    bos = tokenizer.bos_token
    if not gguf.metadata.get("tokenizer.ggml.add_bos_token") or bos is None:
        return
    if tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]:
        return
    from tokenizers.processors import TemplateProcessing

    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tokenizer.bos_token_id)])


def generation_config(config, tokenizer, gguf: GGUFFile):
    """Generation stops at the file's EOS and at its family's end-of-turn tokens (a chat answer ends there)."""
    from transformers import GenerationConfig

    vocabulary = tokenizer.get_vocab()
    stops = [gguf.metadata.get(f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    stops += [vocabulary.get(token) for token in END_OF_TURN_TOKENS]
    stop_ids = sorted({token for token in stops if isinstance(token, int) and 0 <= token < config.vocab_size})
    return GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=stop_ids or None,
                            pad_token_id=config.pad_token_id)


def hf_tensors(gguf: GGUFFile, hp: Hyperparameters) -> Iterator[tuple[str, np.ndarray]]:
    """Every weight the architecture reads, by its Hugging Face name, dequantized to float32 in HF's layout."""
    for name in gguf.tensors:
        hf_name = _hf_name(name, hp.architecture)
        if hf_name is None:
            continue
        values = _dequantized(gguf, name)
        values = values.reshape(values.shape[0], -1) if len(gguf.tensors[name].shape) > 1 else values.reshape(-1)
        if hp.architecture == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = hp.num_heads if name.endswith("attn_q.weight") else hp.num_kv_heads
            values = _unpermute(values, heads)
        if hp.architecture == "gemma3" and name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        yield hf_name, np.ascontiguousarray(values, dtype=np.float32)


def _hf_name(name: str, architecture: str) -> str | None:
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "blk":
        return None  # rope_freqs.weight: read into the config
    _, index, module, kind = parts
    post_attention = "post_attention_layernorm"
    names = dict(LAYER_NAMES, ffn_norm="pre_feedforward_layernorm" if architecture == "gemma3" else post_attention,
                 post_attention_norm=post_attention)
    return f"model.layers.{index}.{names[module]}.{kind}" if module in names else None


def _dequantized(gguf: GGUFFile, name: str) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants

    tensor = gguf.tensors[name]
    return np.asarray(quants.dequantize(gguf.tensor_data(name), GGMLQuantizationType[tensor.type_name]),
                      dtype=np.float32)


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf's q/k row permutation for `llama`, undone."""
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _write_weights(gguf: GGUFFile, hp: Hyperparameters, target: Path) -> None:
    """Shards of about SHARD_BYTES and their index, as save_pretrained writes them."""
    from safetensors.numpy import save_file

    shard: dict[str, np.ndarray] = {}
    weight_map: dict[str, str] = {}
    shard_bytes = total = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        file_name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(target / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
        shard, shard_bytes = {}, 0

    for name, values in hf_tensors(gguf, hp):
        if shard and shard_bytes + values.nbytes > SHARD_BYTES:
            flush()
        shard[name], shard_bytes, total = values, shard_bytes + values.nbytes, total + values.nbytes
    if shard:
        flush()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (target / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))

"""A Hugging Face folder's weights written once as GGUF blocks in the cache (`quantize`: q8_0 or q4_0), so that a
folder of a family the 4-bit kernels run is served by the same decoder as a GGUF file: the per-row KV cache, the
prefix cache and the kernels. Tensors are named and laid out as llama.cpp's convert_hf_to_gguf.py writes them
(llama's q/k rows permuted, Gemma's norms stored as 1 + w), so Q4Weights.from_gguf reads them as it reads a user's
file. Embeddings and an untied lm_head are Q8_0 either way (as llama.cpp's 4-bit files keep them wider); norms and
biases float32. The blocks are gguf-py's own quantization.

Runs in the model worker, at load (it reads the folder's safetensors with torch).
"""
import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from .config import QUANTIZE
from .errors import InvalidRequest

logger = logging.getLogger(__name__)

# transformers' model_type -> the GGUF architecture the kernels run (Mistral-style models are llama files)
FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3_text": "gemma3"}
EMBEDDINGS = ("model.embed_tokens.weight", "lm_head.weight")
FORMAT_VERSION = 1  # in the cache key: a change to what is written here writes the blocks again
BLOCK_VALUES = 32  # Q8_0 and Q4_0 blocks: a row's length must be a multiple


class UnsupportedQuantize(InvalidRequest):
    def __init__(self, message: str):
        super().__init__(message, "quantize")


def architecture_of(model_dir: str) -> str | None:
    """The GGUF architecture a folder's model would be, or None where the kernels do not run its family."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return FAMILIES.get(config.get("model_type")) if isinstance(config, dict) else None


def gguf_name(name: str, architecture: str) -> str:
    """convert_hf_to_gguf's name of a transformers tensor."""
    renames = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
    if name in renames:
        return renames[name]
    _, _, index, *rest = name.split(".")
    module, kind = ".".join(rest).rsplit(".", 1)
    post_attention = "post_attention_norm" if architecture == "gemma3" else "ffn_norm"
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
             "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": post_attention,
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    return f"blk.{index}.{parts[module]}.{kind}"


def permute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order for `llama` (rotary halves interleaved per head)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def quantized_blocks(model_dir: str, quantize: str, cache_dir: str) -> Path:
    """The folder's blocks in the cache, written first where they are missing or the folder's weights changed."""
    target = quantized_path(model_dir, quantize, cache_dir)
    if not target.exists():
        logger.info("quantizing %s to %s into %s (once)", model_dir, quantize, target)
        export(model_dir, target, quantize)
    return target


def export(model_dir: str, target: Path, quantize: str) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter

    architecture = architecture_of(model_dir)
    if architecture is None or quantize not in QUANTIZE[1:]:
        raise UnsupportedQuantize(f"quantize={quantize} runs {', '.join(sorted(FAMILIES))} folders")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": _kv_heads(config)}
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    writer = GGUFWriter(str(partial), architecture)
    write_hyperparameters(writer, config, architecture)
    writer.add_token_list(_token_list(model_dir, config.vocab_size))  # the folder's tokenizer serves the text
    for name, values in _tensors(model_dir):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if values.ndim == 1:  # norms and biases, float32 (Gemma's norms as they multiply: 1 + w)
            shift = 1.0 if architecture == "gemma3" and name.endswith("norm.weight") else 0.0
            writer.add_tensor(gguf_name(name, architecture), values + shift)
            continue
        module = name.rsplit(".", 1)[0].split(".", 3)[-1]
        if architecture == "llama" and module in heads:
            values = permute_rows(values, heads[module])
        qtype = GGMLQuantizationType.Q8_0 if name in EMBEDDINGS or quantize == "q8_0" else GGMLQuantizationType.Q4_0
        writer.add_tensor(gguf_name(name, architecture), _quantized(values, qtype, name), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, target)  # whole or not at all: another worker may be writing the same blocks


def write_hyperparameters(writer, config, architecture: str) -> None:
    """The fields a GGUF of `config`'s model holds (what engine/gguf_file.py checks)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(_kv_heads(config))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float((getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if architecture == "gemma3":
        writer.add_sliding_window(config.sliding_window)


def _token_list(model_dir: str, num_rows: int) -> list[str]:
    """The vocabulary by id, as a GGUF names its tokens (a file's tokenizer fields are checked on reading)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [str(token) for token in tokenizer.convert_ids_to_tokens(list(range(min(len(tokenizer), num_rows))))]


def _kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def _tensors(model_dir: str):
    """(name, float32 values) of every tensor of the folder's safetensors, one at a time."""
    import torch
    from safetensors import safe_open

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise UnsupportedQuantize(f"{model_dir} holds no .safetensors weights to quantize")
    for path in files:
        with safe_open(str(path), framework="pt") as weights:
            for name in weights.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name.startswith("model.") or name == "lm_head.weight":
                    yield name, weights.get_tensor(name).to(torch.float32).numpy()


def _quantized(values: np.ndarray, qtype, name: str) -> np.ndarray:
    from gguf import quants

    if values.shape[-1] % BLOCK_VALUES:
        raise UnsupportedQuantize(f"{name} has rows of {values.shape[-1]} values, not whole blocks of "
                                  f"{BLOCK_VALUES}: it cannot be quantized")
    return quants.quantize(np.ascontiguousarray(values), qtype)


def quantized_path(model_dir: str, quantize: str, cache_dir: str) -> Path:
    """Named after the folder and keyed by its weights (each file's name, size and time) and the format."""
    resolved = Path(model_dir).resolve()
    files = sorted(resolved.glob("*.safetensors"))
    key = json.dumps([str(resolved), quantize, FORMAT_VERSION,
                      [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return Path(cache_dir) / "models" / "quantized" / f"{resolved.name[:80]}-{quantize}-{digest}.gguf"

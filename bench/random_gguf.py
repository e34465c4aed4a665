"""A random-weight GGUF at a real model's shape, for `bench compare --model`: float16 tensors written by gguf-py's
writer with the embedded model's tokenizer (so prompts and token counts are real), then quantized by llama.cpp's
own `llama-quantize` (built by `make llama-server`) to the mix of block types a real file of that type holds.

    python -m bench.random_gguf --shape llama-3.2-1b --type Q4_K_M [--out .cache/bench/models]

Random weights say nothing of quality: these files measure speed only. The vocabulary is the embedded model's
49,152 tokens, smaller than the real models' (128,256 for Llama 3.x, 151,936 for Qwen2.5): the lm_head's share of
a step is smaller than theirs (llama-3.1-8b's Q4_K_M: 4.47 GB, the real file's 4.92 GB). The float16 file is written
tensor by tensor (about 1.7 GB of memory for llama-3.1-8b's 14.8 GB) and kept beside the quantized one.
"""
import argparse
import logging
import math
import subprocess
from pathlib import Path

import numpy as np

from engine.gguf_file import add_metadata, read_gguf
from engine.model_store import find_gguf

from .peers import LLAMA_SRC

logger = logging.getLogger(__name__)

# architecture, hidden, intermediate, layers, heads, kv heads, tied embeddings
SHAPES = {"llama-3.2-1b": ("llama", 2048, 8192, 16, 32, 8, True),
          "llama-3.2-3b": ("llama", 3072, 8192, 28, 24, 8, True),
          "llama-3.1-8b": ("llama", 4096, 14336, 32, 32, 8, False),
          "smollm2-360m": ("llama", 960, 2560, 32, 15, 5, True),
          "qwen2.5-0.5b": ("qwen2", 896, 4864, 24, 14, 2, True),
          "qwen2.5-1.5b": ("qwen2", 1536, 8960, 28, 12, 2, True)}
LLAMA_QUANTIZE = LLAMA_SRC / "build" / "bin" / "llama-quantize"
DEFAULT_OUT = Path(__file__).resolve().parent.parent / ".cache" / "bench" / "models"


def write_float16(path: Path, shape: str, seed: int = 0) -> None:
    from gguf import GGUFWriter

    arch, hidden, intermediate, layers, heads, kv_heads, tied = SHAPES[shape]
    head_dim = hidden // heads
    embedded = read_gguf(str(find_gguf()))
    vocab = len(embedded.metadata["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), arch)
    writer.add_name(f"random {shape}")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(1)  # mostly F16
    for key, value in embedded.metadata.items():
        if key.startswith("tokenizer."):
            add_metadata(writer, key, value)

    # (name, numpy shape, fill): "random" is float16, N(0, 0.02); "ones" and "zeros" are float32
    tensors = [("token_embd.weight", (vocab, hidden), "random")]
    if not tied:
        tensors.append(("output.weight", (vocab, hidden), "random"))
    tensors.append(("output_norm.weight", (hidden,), "ones"))
    for i in range(layers):
        block = f"blk.{i}."
        for name, rows, columns in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                    ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, hidden),
                                    ("ffn_gate", intermediate, hidden), ("ffn_up", intermediate, hidden),
                                    ("ffn_down", hidden, intermediate)):
            tensors.append((block + name + ".weight", (rows, columns), "random"))
        if arch == "qwen2":
            for name, width in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                                ("attn_v", kv_heads * head_dim)):
                tensors.append((block + name + ".bias", (width,), "zeros"))
        for name in ("attn_norm", "ffn_norm"):
            tensors.append((block + name + ".weight", (hidden,), "ones"))

    def data(shape: tuple[int, ...], fill: str) -> np.ndarray:
        if fill == "random":
            return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
        return (np.ones if fill == "ones" else np.zeros)(shape, dtype=np.float32)

    # Streamed: every tensor's info first, then each tensor made as it is written, so memory holds one tensor at a
    # time (an 8B model's float16 is ~16 GB); the values are those of making them all up front, in the same order.
    for name, shape, fill in tensors:
        dtype = np.dtype(np.float16 if fill == "random" else np.float32)
        writer.add_tensor_info(name, shape, dtype, math.prod(shape) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, shape, fill in tensors:
        writer.write_tensor_data(data(shape, fill))
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type (Q4_K_M, Q5_K_M, Q6_K, Q8_0, "
                                                         "Q4_0, ...), or F16 to keep the float16 file")
    parser.add_argument("--out", default=str(DEFAULT_OUT))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    float16 = out / f"random-{args.shape}-F16.gguf"
    if not float16.exists():
        write_float16(float16, args.shape)
    if args.type.upper() == "F16":
        logger.info("%s", float16)
        return
    if not LLAMA_QUANTIZE.exists():
        raise SystemExit(f"{LLAMA_QUANTIZE} is not built: `make llama-server`")
    quantized = out / f"random-{args.shape}-{args.type}.gguf"
    subprocess.run([str(LLAMA_QUANTIZE), str(float16), str(quantized), args.type], check=True,
                   stdout=subprocess.DEVNULL)
    logger.info("%s: %s", quantized, read_gguf(str(quantized)).type_counts())


if __name__ == "__main__":
    main()

"""A random-weight GGUF at a real model's shape, for `bench compare --model`: float16 tensors written by gguf-py's
writer with the embedded model's tokenizer (so prompts and token counts are real), then quantized by llama.cpp's
own `llama-quantize` (built by `make llama-server`) to the mix of block types a real file of that type holds.

    python -m bench.random_gguf --shape llama-3.2-1b --type Q4_K_M [--out .cache/bench/models]

Random weights say nothing of quality: these files measure speed only. The vocabulary is the embedded model's
49,152 tokens, smaller than the real models' (128,256 for Llama 3.2, 151,936 for Qwen2.5): the lm_head's share of
a step is smaller than theirs.
"""
import argparse
import logging
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

    def matrix(rows: int, columns: int) -> np.ndarray:
        return (rng.standard_normal((rows, columns), dtype=np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", matrix(vocab, hidden))
    if not tied:
        writer.add_tensor("output.weight", matrix(vocab, hidden))
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        block = f"blk.{i}."
        for name, rows, columns in (("attn_q", heads * head_dim, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                    ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, hidden),
                                    ("ffn_gate", intermediate, hidden), ("ffn_up", intermediate, hidden),
                                    ("ffn_down", hidden, intermediate)):
            writer.add_tensor(block + name + ".weight", matrix(rows, columns))
        if arch == "qwen2":
            for name, width in (("attn_q", heads * head_dim), ("attn_k", kv_heads * head_dim),
                                ("attn_v", kv_heads * head_dim)):
                writer.add_tensor(block + name + ".bias", np.zeros(width, dtype=np.float32))
        for name in ("attn_norm", "ffn_norm"):
            writer.add_tensor(block + name + ".weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
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

"""Small GGUF files of each family lockstep serves, written at test time with gguf-py's writer, beside a Hugging Face
folder of the very same weights (the reference the served file must compute like).

Weights are random, at shapes whose rows are whole K-quant blocks (256 values); each projection is stored in one of
the block types a real Q4_K_M / Q5_K_M / Q6_K / Q8_0 / Q4_0 file holds. gguf-py quantizes F32, F16, BF16, Q8_0, Q4_0
and Q4_1; the other types get random valid blocks (random bits, scales set to sizes that give weights of about
0.05). The reference's weights are gguf-py's own dequantization of the stored blocks, written the way llama.cpp's
convert_hf_to_gguf.py writes a model: q/k rows permuted for `llama`, norms stored as 1 + w for `gemma3`. The
tokenizer is the embedded model's (its GGUF fields copied), so text and chat templates are real.

Run in a child process (tests/torch_jobs.py): it uses torch.
"""
import numpy as np

# Where each type's float16 scales sit in a block and how large they are (random bits elsewhere).
RANDOM_BLOCK_SCALES = {"Q5_0": ((0, 0.005),), "Q5_1": ((0, 0.003), (2, -0.05)), "Q4_K": ((0, 1e-4), (2, 1e-4)),
                       "Q5_K": ((0, 5e-5), (2, 5e-5)), "Q6_K": ((208, 2.5e-5),)}
TYPE_CYCLE = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "F16", "BF16", "F32")
FAMILY_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6)


def hf_config(family: str, tokenizer):
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(FAMILY_SHAPE, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, rope_theta=10000.0)
    if family == "llama":
        return LlamaConfig(tie_word_embeddings=False, **common)
    if family == "qwen2":
        return Qwen2Config(tie_word_embeddings=True, **common)
    if family == "qwen3":
        return Qwen3Config(tie_word_embeddings=True, **common)
    return Gemma3TextConfig(tie_word_embeddings=True, sliding_window=8, query_pre_attn_scalar=64,
                            **common)


def stored_blocks(values: np.ndarray, type_name: str, rng: np.random.Generator) -> np.ndarray:
    """`values` ([rows, columns] float32) stored as `type_name`: gguf-py's quantization, or random valid blocks."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[type_name]
    if type_name not in RANDOM_BLOCK_SCALES:
        return quants.quantize(values.astype(np.float32), qtype)
    block_values, block_bytes = GGML_QUANT_SIZES[qtype]
    rows, columns = values.shape
    blocks = rng.integers(0, 256, size=(rows, columns // block_values, block_bytes), dtype=np.uint8)
    for offset, size in RANDOM_BLOCK_SCALES[type_name]:
        scales = (size * rng.uniform(0.5, 1.0, size=blocks.shape[:2])).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


def q4_k_quantized(values: np.ndarray) -> np.ndarray:
    """`values` ([rows, columns] float32, columns % 256 == 0) as Q4_K blocks by a plain min/max rounding (gguf-py
    quantizes no K-quant): each 32 values' minimum and step, as 6-bit multiples of the super-block's fp16 dmin and d.
    Unlike random blocks, each sub-block's minimum centers its values (random Q4_K weights all lean one way, and
    a model of them answers one token to everything)."""
    rows = values.shape[0]
    x = values.reshape(-1, 8, 32).astype(np.float32)  # [super-blocks, sub-blocks, 32]
    low, high = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
    steps, minimums = (high - low) / 15, -low
    d = (steps.max(-1) / 63).astype(np.float16)
    dmin = (minimums.max(-1) / 63).astype(np.float16)
    safe = lambda v: np.where(v == 0, 1, v).astype(np.float32)  # noqa: E731
    sc = np.clip(np.rint(steps / safe(d)[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.rint(minimums / safe(dmin)[:, None]), 0, 63).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc
    q = np.clip(np.rint((x + (dmin.astype(np.float32)[:, None] * m)[..., None]) / safe(scale)[..., None]), 0, 15)
    q = q.astype(np.uint8)
    packed = np.empty((x.shape[0], 12), dtype=np.uint8)  # ggml's get_scale_min_k4, inverted
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # chunk c: sub-block 2c low, 2c + 1 high
    blocks = np.concatenate([d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed, qs], axis=1)
    return blocks.reshape(rows, -1)


def tokenizer_fields(embedded_gguf) -> dict:
    return {key: value for key, value in embedded_gguf.metadata.items() if key.startswith("tokenizer.")}


def write_model(target: str, family: str, tokenizer_dir: str, types: tuple[str, ...] = TYPE_CYCLE,
                seed: int = 0, embedding_type: str = "Q8_0", add_bos_to: tuple[str, ...] = (),
                prompts: tuple[tuple[int, ...], ...] = (), num_tokens: int = 8,
                chat_template: str | None = None, quantize_q4_k: bool = False) -> dict:
    """`add_bos_to`: the families whose file says tokenizer.ggml.add_bos_token (the embedded model's says not).
    `quantize_q4_k`: Q4_K tensors quantized from the values (q4_k_quantized) instead of random blocks.
    `chat_template`: the file's own (else the embedded model's).
    `prompts`: token ids whose `num_tokens` greedy tokens (EOS ignored) the reference computes ("greedy")."""
    import torch
    from gguf import GGMLQuantizationType, GGUFWriter, quants
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.gguf_export import gguf_name, permute_rows, write_hyperparameters
    from engine.gguf_file import add_metadata, read_gguf
    from engine.model_store import find_gguf

    rng = np.random.default_rng(seed)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = hf_config(family, tokenizer)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    writer = GGUFWriter(f"{target}/{family}.gguf", family)
    write_hyperparameters(writer, config, family)
    fields = tokenizer_fields(read_gguf(str(find_gguf())))
    fields["tokenizer.ggml.add_bos_token"] = family in add_bos_to
    if chat_template is not None:
        fields["tokenizer.chat_template"] = chat_template
    for key, value in fields.items():
        add_metadata(writer, key, value)
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    type_index = 0
    state = model.state_dict()
    with torch.no_grad():
        for name, parameter in state.items():
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue
            values = rng.normal(0.0, 0.05, size=tuple(parameter.shape)).astype(np.float32)
            if parameter.dim() == 1:  # norms (about 1) and biases: float32, as every converter stores them
                values = values + (0.0 if family == "gemma3" or name.endswith(".bias") else 1.0)
                parameter.copy_(torch.from_numpy(values))
                stored = values + (1.0 if family == "gemma3" and name.endswith("norm.weight") else 0.0)
                writer.add_tensor(gguf_name(name, family), stored)
                continue
            type_name = embedding_type if name in ("model.embed_tokens.weight", "lm_head.weight") \
                else types[type_index % len(types)]
            type_index += name not in ("model.embed_tokens.weight", "lm_head.weight")
            blocks = q4_k_quantized(values) if quantize_q4_k and type_name == "Q4_K" else \
                stored_blocks(values, type_name, rng)
            qtype = GGMLQuantizationType[type_name]
            parameter.copy_(torch.from_numpy(np.asarray(quants.dequantize(blocks, qtype), dtype=np.float32)))
            module = name.rsplit(".", 1)[0].split(".", 3)[-1]
            if family == "llama" and module in heads:
                blocks = permute_rows(blocks, heads[module])
            raw = blocks if type_name not in ("F32",) else blocks.astype(np.float32)
            writer.add_tensor(gguf_name(name, family), raw, raw_dtype=qtype if type_name != "F32" else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(state)
    reference = f"{target}/{family}-reference"
    model.save_pretrained(reference)
    tokenizer.save_pretrained(reference)
    model.generation_config.eos_token_id = None  # exactly num_tokens each
    with torch.inference_mode():
        greedy = [model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                                 pad_token_id=0)[0, len(prompt):].tolist() for prompt in prompts]
    return {"gguf": f"{target}/{family}.gguf", "reference": reference, "greedy": greedy}

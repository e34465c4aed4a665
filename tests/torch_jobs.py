"""Torch work that tests need, run in a child process.

Building tiny models and computing reference outputs (whole models in float32, on every core)
happen here, in a fresh interpreter (`python -m tests.torch_jobs`): their memory and torch's
thread pools never stay in the test process.
"""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_job(name: str, **kwargs):
    done = subprocess.run([sys.executable, "-m", "tests.torch_jobs", name, json.dumps(kwargs)], cwd=REPO,
                          capture_output=True, text=True, check=False, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"torch job {name} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_tiny_model(target: str, architecture: str, tokenizer_dir: str) -> str:
    """A random-weight model with the real SmolLM2 tokenizer (so text and chat templates are real)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    if architecture == "llama":
        config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
                             tie_word_embeddings=False, **common)
        model = LlamaForCausalLM(config)
    else:
        config = OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=256, word_embed_proj_dim=64, init_std=0.2, **common)
        model = OPTForCausalLM(config)
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


def recompute_greedy(model_dir: str, prompts: list[list[int]], num_tokens: int, dtype: str = "float32",
                     weights: str = "exact", device: str = "cpu"):
    """The original design's decoding: no KV cache, the whole sequence re-run for every token (with weights="q4":
    on the embedded model's 4-bit blocks and lockstep's kernels, a fresh prompt cache each time)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    next_logits = (lambda ids: model(torch.tensor([ids], device=device), use_cache=False).logits[0, -1]) \
        if weights == "exact" \
        else _q4_recompute(model, model_dir)
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(num_tokens):
                ids.append(int(next_logits(ids).float().argmax()))
            outputs.append(ids[len(prompt):])
    return outputs


def _q4_recompute(model, model_dir: str):
    import torch

    from engine.backends.fast_forward import FastDecoder
    from engine.backends.q4 import Q4Weights, load_q4_kernels
    from engine.config import EngineConfig
    from engine.model_store import gguf_of

    weights = Q4Weights.from_gguf(gguf_of(model_dir, EngineConfig()), model.config)
    weights.give_model_the_same_weights(model)
    decoder = FastDecoder(model, q4=(load_q4_kernels(EngineConfig().cache_dir, helpers=0), weights))

    def next_logits(ids):
        return decoder.prefill(torch.tensor(ids), 0, decoder.new_prompt_cache(len(ids)))

    return next_logits


def build_gguf_models(target: str, families: list[str], tokenizer_dir: str, **options) -> dict:
    """tests/gguf_models.py's file and reference folder of each family (the n-th family seeded with n)."""
    from tests.gguf_models import write_model

    return {family: write_model(target, family, tokenizer_dir, seed=seed, **options)
            for seed, family in enumerate(families)}


def same_blocks_greedy(model_dir: str, gguf: str, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """The float32 model given exactly the weights the 4-bit kernels read from `gguf` (block_repack.py: as this
    host's kernels keep them, a file's Q4_0, Q4_K and Q6_K as they are where they interleave), decoding greedily with
    its own forward (EOS ignored)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.backends.q4 import Q4Weights, load_q4_kernels
    from engine.config import default_cache_dir

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kernels = load_q4_kernels(default_cache_dir(), helpers=0, exact=True)
    Q4Weights.from_gguf(gguf, model.config, kernels).give_model_the_same_weights(model)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        return [model.generate(torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False,
                               pad_token_id=0)[0, len(prompt):].tolist() for prompt in prompts]


def unequal_parameters(model_dir: str, reference_dir: str, dtype: str) -> list[str]:
    """The parameters (and buffers) of `model_dir`'s model as the worker loads it that differ from
    `reference_dir`'s `from_pretrained`, both in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.backends.gguf_weights import load_model

    loaded = load_model(model_dir, getattr(torch, dtype))
    reference = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=getattr(torch, dtype))
    pairs = [(dict(loaded.named_parameters()), dict(reference.named_parameters())),
             (dict(loaded.named_buffers()), dict(reference.named_buffers()))]
    return sorted(set().union(*(set(a) ^ set(b) for a, b in pairs)) | {
        name for a, b in pairs for name in set(a) & set(b)
        if a[name].dtype != b[name].dtype or not torch.equal(a[name], b[name])})


if __name__ == "__main__":
    job, arguments = sys.argv[1], json.loads(sys.argv[2])
    jobs = {"build_tiny_model": build_tiny_model, "recompute_greedy": recompute_greedy,
            "build_gguf_models": build_gguf_models, "same_blocks_greedy": same_blocks_greedy,
            "unequal_parameters": unequal_parameters}
    result = jobs[job](**arguments)
    sys.stdout.write(json.dumps(result) + "\n")

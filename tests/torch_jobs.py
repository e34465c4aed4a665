"""Torch work that tests need, run in a child process.

The test process forks model workers; if it ran a multi-threaded torch op itself, those
children could hang on their first parallel op (see the brief). So building tiny models and
computing reference outputs happen here, in a fresh interpreter: `python -m tests.torch_jobs`.
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


def recompute_greedy(model_dir: str, prompts: list[list[int]], num_tokens: int, dtype: str = "float32"):
    """The original design's decoding: no KV cache, the whole sequence re-run for every token."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(num_tokens):
                logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
                ids.append(int(logits.float().argmax()))
            outputs.append(ids[len(prompt):])
    return outputs


if __name__ == "__main__":
    job, arguments = sys.argv[1], json.loads(sys.argv[2])
    result = {"build_tiny_model": build_tiny_model, "recompute_greedy": recompute_greedy}[job](**arguments)
    sys.stdout.write(json.dumps(result) + "\n")

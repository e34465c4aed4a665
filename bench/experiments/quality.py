"""What the 4-bit path costs in quality: lockstep's ways of computing the embedded model against its reference, the
float32 dequantized GGUF (the model's true weights in float32, transformers' forward).

    python -m bench.experiments.quality [--tokens 64]

For each way: the teacher-forced agreement (the next-token argmax at every position of a fixed text, and of the
reference's own greedy answers to four prompts), the greedy tokens each prompt shares with the reference's before
the first difference, and the perplexity of the fixed text (the reference's in the table's first row).
"""
import argparse
import logging

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.backends.fast_forward import FastDecoder
from engine.backends.kv_cache import use_slot_attention
from engine.backends.q4 import Q4Weights, load_q4_kernels
from engine.config import EngineConfig
from engine.hardware import detect_host
from engine.model_store import default_model_dir

TEXT = ("The ocean covers more than seventy percent of the surface of the Earth. It holds most of the planet's "
        "water and is home to a vast range of life, from tiny plankton to the blue whale, the largest animal that "
        "has ever lived. Ocean currents carry heat from the equator toward the poles and shape the weather on "
        "land. Scientists study the ocean with ships, buoys and satellites, and yet much of the deep sea remains "
        "unexplored. Protecting it from pollution and overfishing is one of the great tasks of this century.")
PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.",
           "Explain what a hash table is in two sentences.", "Give three tips for learning to cook."]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.experiments.quality", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)
    model_dir = str(default_model_dir(EngineConfig().cache_dir))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    weights = Q4Weights.of_embedded_model(reference.config, EngineConfig().cache_dir)
    weights.give_model_the_same_weights(reference)
    use_slot_attention(reference)
    decoders = {exact: FastDecoder(reference, q4=(load_q4_kernels(EngineConfig().cache_dir, helpers=1, exact=exact),
                                                  weights))
                for exact in (False, True)}
    prepared = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def on_kernels(exact: bool):
        decoder = decoders[exact]
        return lambda ids: decoder.prefill(torch.tensor(ids), 0, decoder.new_prompt_cache(len(ids)),
                                           all_positions=True)

    ways = {"float32 dequantized GGUF (reference)": lambda ids: forward(reference, ids),
            "4-bit blocks on lockstep's kernels (weights=q4)": on_kernels(False),
            "the blocks on float32 activations (weights=exact)": on_kernels(True),
            "prepared bfloat16 weights in float32": lambda ids: forward(prepared, ids)}
    if detect_host().has_native_bf16:  # elsewhere bfloat16 is emulated: slow, and never a default
        bf16 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
        ways["prepared bfloat16 weights in bfloat16"] = lambda ids: forward(bf16, ids)
    text = tokenizer(TEXT)["input_ids"]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False))
               for p in PROMPTS]
    answers = [greedy(ways["float32 dequantized GGUF (reference)"], p, args.tokens) for p in prompts]
    rows = ["| computed as | argmax agreement, fixed text | argmax agreement, reference answers | greedy tokens "
            "shared before the first difference | perplexity of the fixed text |", "|---|---:|---:|---|---:|"]
    expected_text = ways["float32 dequantized GGUF (reference)"](text).argmax(-1)
    with torch.inference_mode():
        for name, way in ways.items():
            logits = way(text)
            on_text = float((logits.argmax(-1) == expected_text).float().mean())
            on_answers = [float((way(p + a)[len(p) - 1:-1].argmax(-1) == torch.tensor(a)).float().mean())
                          for p, a in zip(prompts, answers)]
            shared = [common_prefix(greedy(way, p, args.tokens), a) for p, a in zip(prompts, answers)]
            perplexity = float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(text[1:])).exp())
            rows.append(f"| {name} | {on_text:.3f} | {sum(on_answers) / len(on_answers):.3f} | "
                        f"{' / '.join(str(n) for n in shared)} of {args.tokens} | {perplexity:.3f} |")
    print("\n".join(rows))  # the table is the output


@torch.inference_mode()
def forward(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0].float()


@torch.inference_mode()
def greedy(way, prompt: list[int], num_tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(way(ids)[-1].argmax()))
    return ids[len(prompt):]


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


if __name__ == "__main__":
    main()

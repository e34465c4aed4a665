"""What `python -m bench serve` sends: prompts (a built-in set, or random tokens as vLLM's `random` dataset) and
output lengths, each request measured in tokens of the model's own tokenizer."""
import random
from dataclasses import dataclass

# Prompts that keep a small instruct model writing prose (about 12-20 tokens each); request i takes prompt
# i mod len, with its number in it so no two prompts of a run are equal (no server may share a prefix cache).
BUILTIN_PROMPTS = (
    "Write a long story about a dragon who learns to cook. Chapter {n}:",
    "Explain in detail how a steam engine works, step {n} of a lecture for engineering students:",
    "Describe a walk through an old city at night, letter number {n} to a friend:",
    "Tell the history of the printing press as a museum guide would, part {n}:",
    "Write a detailed travel diary of a journey across the mountains, day {n}:",
    "Explain to a child why the sky is blue and sunsets are red, lesson {n}:",
    "Write the opening of a mystery novel set on a night train, draft {n}:",
    "Describe how bread is made from the field to the bakery, episode {n} of a documentary:",
)


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt: str
    prompt_len: int  # tokens of `prompt` by the model's tokenizer (no special tokens added)
    output_len: int  # max_tokens asked for


def output_lengths(num_requests: int, output_len: int, range_ratio: float, rng: random.Random) -> list[int]:
    """Uniform in [output_len * (1 - range_ratio), output_len * (1 + range_ratio)], at least 1 (vLLM's rule)."""
    low, high = max(1, round(output_len * (1 - range_ratio))), max(1, round(output_len * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(num_requests)]


def builtin_requests(tokenizer, num_requests: int, output_len: int, range_ratio: float = 0.0,
                     seed: int = 0) -> list[RequestSpec]:
    rng = random.Random(seed)
    lengths = output_lengths(num_requests, output_len, range_ratio, rng)
    prompts = [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)].format(n=i + 1) for i in range(num_requests)]
    return [RequestSpec(i, prompt, count_tokens(tokenizer, prompt), lengths[i]) for i, prompt in enumerate(prompts)]


def random_requests(tokenizer, num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0) -> list[RequestSpec]:
    """Prompts of random ordinary (not special) tokens, decoded to text; `prompt_len` is re-counted on that text,
    since decoding and encoding again may merge or split a few tokens."""
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    vocabulary = [i for i in range(len(tokenizer)) if i not in special]
    input_lengths = output_lengths(num_requests, input_len, range_ratio, rng)
    lengths = output_lengths(num_requests, output_len, range_ratio, rng)
    specs = []
    for i in range(num_requests):
        prompt = tokenizer.decode([rng.choice(vocabulary) for _ in range(input_lengths[i])])
        specs.append(RequestSpec(i, prompt, count_tokens(tokenizer, prompt), lengths[i]))
    return specs


def count_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids) if text else 0


def default_model_dir() -> str:
    """lockstep's prepared default model (prepared once if missing)."""
    from engine import EngineConfig
    from engine.model_store import resolve_model

    return resolve_model(EngineConfig())


def load_tokenizer(path: str | None = None):
    """The model's tokenizer: `path`, or the default model's."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path or default_model_dir())

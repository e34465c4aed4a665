"""Greedy completions of one GGUF file by lockstep and by llama.cpp's llama-server, side by side: does lockstep
compute what llama.cpp computes on the same file?

    python -m bench.agreement --model FILE [--tokens 32] [--settings LOCKSTEP_WEIGHTS=exact,...]

Both servers get the built-in prompts as plain completions (greedy, `ignore_eos`); each answer is tokenized with
the file's tokenizer and the table gives, per prompt, whether the first token agrees and how many tokens the two
answers share from the start. Rounding differs between the two (llama.cpp rounds activations to 8 bits per 256
values for K-quants, lockstep's kernels per 32, its other paths not at all), so a long common prefix, not equality,
is what agreement looks like; random-weight files (bench/random_gguf.py) have flat logits and agree least.
"""
import argparse
import logging
import json
import urllib.request
from pathlib import Path

from engine import EngineConfig
from engine.model_store import prepared_model

from . import serve_data
from .peers import LLAMA_SERVER, SERVED_NAME, ServerConfig, start_server

logger = logging.getLogger(__name__)

OUT_DIR = Path(__file__).resolve().parent.parent / ".cache" / "bench" / "agreement"
READY_TIMEOUT_S = 600


def complete(url: str, model: str, prompt: str, tokens: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())["choices"][0]["text"]


def answers(server, model: str, prompts: list[str], tokens: int) -> list[str]:
    server.wait_ready(READY_TIMEOUT_S)
    try:
        return [complete(server.url, model, prompt, tokens) for prompt in prompts]
    finally:
        server.stop()


def common_prefix(first: list[int], second: list[int]) -> int:
    length = 0
    for a, b in zip(first, second):
        if a != b:
            break
        length += 1
    return length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a GGUF file")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--settings", default="", help="LOCKSTEP_*=value pairs, comma separated")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not LLAMA_SERVER.exists():
        raise SystemExit(f"{LLAMA_SERVER} is not built: `make llama-server`")
    gguf = str(Path(args.model).resolve())
    prompts = [prompt.format(n=1) for prompt in serve_data.BUILTIN_PROMPTS]
    model_dir = str(prepared_model(gguf, EngineConfig().cache_dir))
    tokenizer = serve_data.load_tokenizer(model_dir)
    settings = dict(pair.split("=", 1) for pair in args.settings.split(",") if pair)
    ours = ServerConfig("lockstep", "lockstep", (("LOCKSTEP_MODEL", gguf), *settings.items()))
    lockstep = answers(start_server(ours, model_dir, OUT_DIR), gguf, prompts, args.tokens)
    peer = ServerConfig("llama-server", "llama-server", gguf=gguf)
    theirs = answers(start_server(peer, model_dir, OUT_DIR), SERVED_NAME, prompts, args.tokens)
    rows, shared = [], []
    for prompt, our_text, peer_text in zip(prompts, lockstep, theirs):
        a, b = (tokenizer(text, add_special_tokens=False)["input_ids"] for text in (our_text, peer_text))
        shared.append(common_prefix(a, b))
        rows.append(f"| {prompt[:40]!r} | {'yes' if a[:1] == b[:1] else 'no'} | {shared[-1]} of {len(b)} |")
    logger.info("%s, %d greedy tokens, lockstep %s against llama-server\n"
                "| prompt | same first token | tokens in common from the start |\n|---|---|---:|\n%s\n"
                "first tokens agree on %d of %d prompts; median common prefix %d tokens", Path(gguf).name,
                args.tokens, settings or "defaults", "\n".join(rows), sum("| yes |" in row for row in rows),
                len(rows), sorted(shared)[len(shared) // 2])


if __name__ == "__main__":
    main()

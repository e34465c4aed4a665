"""Multi-turn chat: does a server reuse the conversation it has already seen?

    python -m bench multiturn [--configs hf,hf-no-cache,llama-server,llama-server-bf16,vllm-server]
                              [--turns 10] [--conversations 2]

Each conversation resends its whole history every turn, as chat clients do: a system message, then per turn a
~110-word user message; every answer is 1 token (greedy, POST /v1/chat/completions) and the history records a
fixed ~55-word assistant reply, so every server sees the same prompts. Prints, per server (started one at a time,
as `bench compare` starts them, on this host), the median request time of turns 1, 5 and 10 over the
conversations (each with its own words, so none reuses another's), turn 10 / turn 1, and the cached prompt
tokens the server reported at turn 10 (`usage.prompt_tokens_details.cached_tokens`, where it reports them).
"""
import argparse
import json
import logging
import random
import statistics
import time
import urllib.request
from dataclasses import dataclass, field

from engine.hardware import detect_host

from . import serve_data
from .compare import CONFIGS, READY_TIMEOUT_S, DEFAULT_OUT_DIR
from .peers import SERVED_NAME, ServerConfig, start_server

logger = logging.getLogger(__name__)

CONFIGS = {**CONFIGS, "hf-no-cache": ServerConfig("lockstep hf, no prefix cache", "lockstep",
                                                  (("LOCKSTEP_PREFIX_CACHE", "false"),))}
DEFAULT_CONFIGS = "hf,hf-no-cache,llama-server,llama-server-bf16,vllm-server"
WORDS = ("river stone garden winter letter market window planet signal harbor valley engine silver forest "
         "morning lantern bridge canvas meadow thunder rhythm castle orchard compass violet marble candle "
         "meadow shadow beacon falcon pepper ribbon summit glacier harvest anchor quartz mosaic timber "
         "copper velvet prairie ember nectar delta orbit pillar saddle tundra willow").split()
REQUEST_TIMEOUT_S = 600


@dataclass
class Conversation:
    turn_seconds: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    cached_tokens: list[int | None] = field(default_factory=list)


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count)) + "."


def run_conversation(url: str, seed: int, turns: int) -> Conversation:
    rng = random.Random(seed)
    messages = [{"role": "system", "content": "You are a helpful assistant. " + words(rng, 20)}]
    result = Conversation()
    for _ in range(turns):
        messages.append({"role": "user", "content": words(rng, 110)})
        body = {"model": SERVED_NAME, "messages": messages, "max_tokens": 1, "temperature": 0}
        request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            answer = json.loads(response.read())
        result.turn_seconds.append(time.perf_counter() - started)
        usage = answer.get("usage") or {}
        result.prompt_tokens.append(usage.get("prompt_tokens", 0))
        result.cached_tokens.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
        messages.append({"role": "assistant", "content": words(rng, 55)})
    return result


def measure(config: ServerConfig, model_dir: str, turns: int, conversations: int) -> list[Conversation] | str:
    if (missing := config.missing()) is not None:
        return missing
    server = start_server(config, model_dir, DEFAULT_OUT_DIR / "multiturn-logs")
    try:
        server.wait_ready(READY_TIMEOUT_S)
        run_conversation(server.url, seed=-1, turns=1)  # warm-up: the first request of a fresh server
        return [run_conversation(server.url, seed, turns) for seed in range(conversations)]
    except RuntimeError as exc:
        return f"failed to start: {str(exc).splitlines()[0][:200]}"
    finally:
        server.stop()


def table(results: dict[str, list[Conversation] | str], turns: int) -> list[str]:
    shown = sorted({1, min(5, turns), turns})
    lines = [f"| server | {' | '.join(f'turn {t}' for t in shown)} | turn {turns} / turn 1 | "
             f"cached at turn {turns} |", "|---|" + "---:|" * (len(shown) + 2)]
    for name, outcome in results.items():
        if isinstance(outcome, str):
            lines.append(f"| {name} | skipped: {outcome} |")
            continue
        medians = {t: statistics.median(c.turn_seconds[t - 1] for c in outcome) * 1000 for t in shown}
        cached = outcome[0].cached_tokens[turns - 1]
        cells = [f"{medians[t]:,.0f} ms ({outcome[0].prompt_tokens[t - 1]:,})" for t in shown]
        lines.append(f"| {name} | {' | '.join(cells)} | {medians[turns] / medians[1]:.2f}x | "
                     f"{'-' if cached is None else f'{cached:,}'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"any of {', '.join(CONFIGS)}")
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--conversations", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model_dir = serve_data.default_model_dir()
    results = {}
    for key in args.configs.split(","):
        config = CONFIGS[key]
        results[config.name] = measure(config, model_dir, args.turns, args.conversations)
        logger.info("%s done", config.name)
    host = detect_host()
    print(f"\n{host.describe()}; flags: {' '.join(sorted(host.flags & ISA_SHOWN))}")
    print(f"request time (prompt tokens), median of {args.conversations} conversations, 1 output token a turn:\n")
    print("\n".join(table(results, args.turns)))


ISA_SHOWN = {"avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_bf16", "asimd", "bf16"}

if __name__ == "__main__":
    main()

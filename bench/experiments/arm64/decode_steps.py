"""lockstep's served decode step for `bench/experiments/arm64/count-decode`: the backend's own `step` (its Python
included) on one thread, STEPS tokens after a prompt (20 tokens unless told) for each of CLIENTS streams, run as ARM64
code under qemu-user with the counting plugin. The script runs it at two step counts and takes the difference: the
instructions of a decode step (or at two prompt lengths, without steps: of the prompt's tokens).

    tests/arm64/run-emulated python -m bench.experiments.arm64.decode_steps --steps 16 [--weights q4|exact]
        [--clients 1] [--prompt-tokens 20]
"""
import argparse
import dataclasses
import logging

from engine.backends.hf import HFBackend
from engine.config import EngineConfig
from engine.messages import NewRequest, WorkerSampling
from engine.model_store import resolve_model

logger = logging.getLogger(__name__)


def decode(steps: int, weights: str, clients: int, prompt_tokens: int) -> None:
    config = EngineConfig(device="cpu", threads=1, kernel_helper_rows=0, weights=weights)  # one thread, no helpers
    model = resolve_model(config)
    backend = HFBackend(dataclasses.replace(config, model=model), model)
    requests = tuple(NewRequest(f"count-{client}", tuple(range(100 + client, 100 + client + prompt_tokens)),
                                WorkerSampling(max_tokens=steps + 1, ignore_eos=True)) for client in range(clients))
    started = set(backend.step(requests, ()).new_token_ids)  # the prompts (or their first chunks)
    while len(started) < clients:  # a long prompt's other chunks, until every stream has its first token
        started |= set(backend.step((), ()).new_token_ids)
    for _ in range(steps):
        backend.step((), ())
    logger.info("decoded %d steps of %d rows on %s", steps, clients, backend.info.compute)
    backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--weights", choices=("q4", "exact"), default="q4")
    parser.add_argument("--clients", type=int, default=1, help="streams decoded together (one row each)")
    parser.add_argument("--prompt-tokens", type=int, default=20, help="each stream's prompt")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    decode(args.steps, args.weights, args.clients, args.prompt_tokens)


if __name__ == "__main__":
    main()

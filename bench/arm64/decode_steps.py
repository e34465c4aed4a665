"""lockstep's served decode step for `bench/arm64/count-decode`: the backend's own `step` (its Python included) on
one thread, STEPS tokens after a 20-token prompt, run as ARM64 code under qemu-user with the counting plugin.
The script runs it at two step counts and takes the difference: the instructions of a decode step.

    tests/arm64/run-emulated python -m bench.arm64.decode_steps --steps 16 [--weights q4|exact]
"""
import argparse
import dataclasses
import logging

from engine.backends.hf import HFBackend
from engine.config import EngineConfig
from engine.messages import NewRequest, WorkerSampling
from engine.model_store import resolve_model

logger = logging.getLogger(__name__)


def decode(steps: int, weights: str) -> None:
    config = EngineConfig(device="cpu", threads=1, kernel_helper_rows=0, weights=weights)  # one thread, no helpers
    model = resolve_model(config)
    backend = HFBackend(dataclasses.replace(config, model=model), model)
    request = NewRequest("count", tuple(range(100, 120)), WorkerSampling(max_tokens=steps + 1, ignore_eos=True))
    backend.step((request,), ())  # the prompt, and its first token
    for _ in range(steps):
        backend.step((), ())
    logger.info("decoded %d steps on %s", steps, backend.info.compute)
    backend.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--weights", choices=("q4", "exact"), default="q4")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    decode(args.steps, args.weights)


if __name__ == "__main__":
    main()

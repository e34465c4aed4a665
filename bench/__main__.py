"""`python -m bench COMMAND [options]`: serve (the serving benchmark), compare (start each server and compare
them), or any other bench module by name (throughput, multiturn, startup, ...; `python -m bench.x` works too), or
one of the experiments in bench/experiments/ (long_prompt, decode_profile, ...).
"""
import importlib.util
import runpy
import sys

COMMANDS = {"serve": "bench.serve", "compare": "bench.compare"}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        sys.stderr.write(__doc__)
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    command = sys.argv[1]
    module = COMMANDS.get(command) or _bench_module(command)
    sys.argv = [f"python -m bench {command}", *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _bench_module(command: str) -> str:
    experiment = f"bench.experiments.{command}"
    return experiment if importlib.util.find_spec(experiment) else f"bench.{command}"


if __name__ == "__main__":
    main()

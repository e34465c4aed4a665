"""`python -m bench COMMAND [options]`: serve (the serving benchmark), compare (start each server and compare
them), or any other bench module by name (throughput, multiturn, long_prompt, ...; `python -m bench.x` works too).
"""
import runpy
import sys

COMMANDS = {"serve": "bench.serve", "compare": "bench.compare"}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        sys.stderr.write(__doc__)
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    command = sys.argv[1]
    module = COMMANDS.get(command, f"bench.{command}")
    sys.argv = [f"python -m bench {command}", *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

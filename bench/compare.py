"""Side by side: start each server configuration in turn, run the same sweep, stop it, compare.

    python -m bench compare [--configs hf,hf-exact,vllm,vllm-server,llama-server,llama-server-bf16]
        [--concurrency 1,8,16]
        [--output-len 128] [--lengths 64,256,1024] [--max-duration 60] [--deadline 120] [--out-dir .cache/bench]
        [--probe/--no-probe] [--probe-streams 8] [--probe-count 15] [--docs docs/benchmarks.md] [--model FILE]

Every configuration gets the same load (bench/serve.py): the built-in prompts, greedy, ignore_eos, closed-loop
clients (at most N requests in flight, 2 requests per client), then, for the configurations marked so, one request
each of 64, 256 and 1,024 output tokens alone (the per-token cost as a sequence grows), then the TTFT of a
~30-token prompt beside 8 running streams (bench/probe.py). Servers that are not
installed are skipped and say so. The ratios compare each lockstep configuration with the peer on the same
weights (llama-server on the Q4_1 GGUF for the defaults, on a bfloat16 GGUF for exact weights), else the best peer,
measured in the same run. Results: a table on the terminal, compare.json and compare.png in
--out-dir, and with --docs the serving section of that Markdown file (and its plot beside it) rewritten.
"""
import argparse
import json
import logging
import math
import os
import shlex
import sys
import time
from dataclasses import replace
from pathlib import Path

from engine import EngineConfig
from engine.model_store import prepared_model

from . import probe, serve, serve_data
from .compare_report import ConfigResult, Plan, Report, describe_machine
from .peers import AVX2_ONLY_ENV, SERVED_NAME, ServerConfig, start_server

logger = logging.getLogger(__name__)

CONFIGS = {
    "hf": ServerConfig("lockstep hf (defaults)", "lockstep", in_length_sweep=True, same_weights_peer="llama-server",
                       description="gunicorn as `make serve` starts it, no settings (what that computes with on "
                                   "each host class: docs/benchmarks.md, the table of host classes)"),
    "hf-q4": ServerConfig("lockstep hf, 4-bit weights", "lockstep", (("LOCKSTEP_WEIGHTS", "q4"),),
                          same_weights_peer="llama-server",
                          description="`LOCKSTEP_WEIGHTS=q4`: the GGUF's 4-bit blocks on lockstep's kernels with "
                                      "8-bit activations (the defaults where bfloat16 is not computed natively)"),
    "hf-1thread": ServerConfig("lockstep hf, one thread", "lockstep", (("LOCKSTEP_KERNEL_HELPER_ROWS", "0"),),
                               same_weights_peer="llama-server",
                               description="`LOCKSTEP_KERNEL_HELPER_ROWS=0`: the kernels without helper threads"),
    "hf-exact": ServerConfig("lockstep hf, exact weights", "lockstep", (("LOCKSTEP_WEIGHTS", "exact"),),
                             same_weights_peer="llama-server bf16",
                             description="`LOCKSTEP_WEIGHTS=exact`: the GGUF's 4-bit blocks on lockstep's kernels "
                                         "with float32 activations (the weights' own numbers; llama-server bf16 "
                                         "computes on them rounded to bfloat16)"),
    "hf-bf16": ServerConfig("lockstep hf, bfloat16", "lockstep", (("LOCKSTEP_DTYPE", "bfloat16"),),
                            same_weights_peer="llama-server bf16",
                            description="`LOCKSTEP_DTYPE=bfloat16`: the prepared bfloat16 model (on AVX512-BF16, "
                                        "lockstep's bfloat16 kernels; emulated, and slow, elsewhere)"),
    "hf-static": ServerConfig("lockstep hf, policy static", "lockstep", (("LOCKSTEP_POLICY", "static"),),
                              description="`LOCKSTEP_POLICY=static`"),
    # One request at a time: 2 requests per client would take minutes at 16 clients, so each client sends one.
    "hf-none": ServerConfig("lockstep hf, policy none", "lockstep", (("LOCKSTEP_POLICY", "none"),),
                            requests_per_client=1,
                            description="`LOCKSTEP_POLICY=none` (one request per client, to bound the run)"),
    "vllm": ServerConfig("lockstep vllm (batch 16)", "lockstep",
                         (("LOCKSTEP_BACKEND", "vllm"), ("LOCKSTEP_MAX_BATCH_SIZE", "16")), in_length_sweep=True,
                         description="`LOCKSTEP_BACKEND=vllm LOCKSTEP_MAX_BATCH_SIZE=16`"),
    "vllm-server": ServerConfig("vLLM server", "vllm-server", is_peer=True, in_length_sweep=True,
                                description="`python -m vllm.entrypoints.openai.api_server --dtype bfloat16 "
                                            "--enforce-eager --max-num-seqs 16`, 1 GiB of KV cache as lockstep's "
                                            "vLLM backend, `ignore_eos` in the body"),
    "llama-server": ServerConfig("llama-server", "llama-server", is_peer=True, in_length_sweep=True,
                                 description="llama.cpp's native server (`make llama-server`) on the embedded Q4_1 "
                                             "GGUF, `-t <cores> -np 16 -c 32768` (and `-nr` on a CPU with AMX-INT8: "
                                             "bench/peers.py), `ignore_eos` in the body"),
    "llama-server-bf16": ServerConfig("llama-server bf16", "llama-server", is_peer=True, gguf="bf16",
                                      description="the same on a bfloat16 GGUF of the prepared model "
                                                  "(convert_hf_to_gguf.py --outtype bf16)"),
    # An AVX2-only CPU's code paths on this one (its memory and cores stay this machine's): lockstep under the
    # capability masks, llama.cpp built for AVX2 (`make llama-server-avx2`).
    "hf-avx2": ServerConfig("lockstep hf, AVX2 path", "lockstep", AVX2_ONLY_ENV, same_weights_peer="llama-server avx2",
                            description="the defaults under the AVX2-only masks (" +
                                        " ".join(f"`{k}={v}`" for k, v in AVX2_ONLY_ENV) + ")"),
    "hf-exact-avx2": ServerConfig("lockstep hf, exact weights, AVX2 path", "lockstep",
                                  (("LOCKSTEP_WEIGHTS", "exact"), *AVX2_ONLY_ENV),
                                  same_weights_peer="llama-server bf16 avx2",
                                  description="`LOCKSTEP_WEIGHTS=exact` under the same masks"),
    "llama-server-avx2": ServerConfig("llama-server avx2", "llama-server", is_peer=True, llama_build="avx2",
                                      description="llama-server built for AVX2+FMA+F16C without AVX-512 "
                                                  "(`make llama-server-avx2`), the Q4_1 GGUF"),
    "llama-server-bf16-avx2": ServerConfig("llama-server bf16 avx2", "llama-server", is_peer=True, gguf="bf16",
                                           llama_build="avx2", description="the same build on the bfloat16 GGUF"),
}
STANDARD = "hf,hf-exact,vllm,vllm-server,llama-server,llama-server-bf16"
READY_TIMEOUT_S = 300
DEFAULT_OUT_DIR = Path(__file__).resolve().parent.parent / ".cache" / "bench"


def run_config(config: ServerConfig, plan: Plan, tokenizer, model_dir: str, out_dir: Path,
               show_progress: bool) -> ConfigResult:
    result = ConfigResult(config, skipped=config.missing())
    if result.skipped:
        logger.warning("%s: skipped (%s)", config.name, result.skipped)
        return result
    started = time.monotonic()
    result.load_average = round(os.getloadavg()[0], 2)
    server = start_server(config, model_dir, out_dir / "logs")
    try:
        server.wait_ready(READY_TIMEOUT_S)
        result.ready_s = time.monotonic() - started
        logger.info("%s: ready in %.0f s", config.name, result.ready_s)
        _run_sweep(result, server.url, plan, tokenizer, show_progress)
        if plan.probe is not None:
            result.probe = probe.measure_config(config, server.url, tokenizer, plan.probe)
    except RuntimeError as exc:  # it did not start: the others still run
        result.skipped = f"failed to start: {str(exc).splitlines()[0][:300]}"  # the report's row: one line
        logger.error("%s: failed to start: %s", config.name, exc)
    finally:
        server.stop()
    return result


def _run_sweep(result: ConfigResult, url: str, plan: Plan, tokenizer, show_progress: bool) -> None:
    config = result.config
    sampling = serve.Sampling.greedy(tokenizer, "field")
    per_client = config.requests_per_client or plan.requests_per_client
    points = [(c, plan.output_len, per_client * c) for c in plan.concurrency]
    if config.in_length_sweep:
        points += [(1, length, 1) for length in plan.lengths]
    for index, (clients, output_len, num_requests) in enumerate(points):
        target = serve.make_target(config.api, url, SERVED_NAME)
        specs = serve_data.builtin_requests(tokenizer, num_requests, output_len)
        shape = serve.LoadShape(math.inf, 1.0, clients, plan.max_duration_s, plan.deadline_s)
        measurement = serve.measure(target, specs, sampling, shape, tokenizer, None, show_progress,
                                    f"{config.name} x{clients} {output_len} tokens")
        is_length_point = index >= len(plan.concurrency)
        if is_length_point:
            result.lengths[output_len] = measurement.metrics
        else:
            result.sweep[clients] = measurement.metrics
        record = serve.run_record(clients, shape, measurement)
        result.records.append({**record, "output_len": output_len, "length_sweep": is_length_point})
        logger.info(serve.table_row(config.name, clients, shape, measurement.metrics))


# -- command line ------------------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=STANDARD, help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--lengths", default="64,256,1024", help="output lengths for the per-token cost (one "
                                                                "client); empty to skip")
    parser.add_argument("--max-duration", type=float, default=60.0, help="s per point before no new requests")
    parser.add_argument("--deadline", type=float, default=120.0, help="s per point before the requests still "
                                                                      "running are cut (and count as failed)")
    parser.add_argument("--probe", action=argparse.BooleanOptionalAction, default=True,
                        help="after each sweep, the TTFT of a ~30-token prompt beside running streams")
    parser.add_argument("--probe-streams", type=int, default=probe.ProbePlan.num_streams)
    parser.add_argument("--probe-count", type=int, default=probe.ProbePlan.num_probes, help="probes per server")
    parser.add_argument("--out-dir", default=str(DEFAULT_OUT_DIR))
    parser.add_argument("--docs", default=None, help="Markdown file whose serving section is rewritten")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--model", default=None, help="a GGUF file: lockstep serves it (LOCKSTEP_MODEL), llama-server "
                                                     "the same file; configurations on another file are skipped")
    parser.add_argument("--from-json", default=None, help="render the report of an earlier run's compare.json "
                                                         "(with --docs: rewrite the section) instead of running")
    args = parser.parse_args(argv)
    unknown = [key for key in args.configs.split(",") if key not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}: choose from {', '.join(CONFIGS)}")
    try:
        probe_plan = probe.ProbePlan(num_streams=args.probe_streams, num_probes=args.probe_count,
                                     deadline_s=args.deadline) if args.probe else None
        args.plan = Plan(_ints(args.concurrency), args.output_len, _ints(args.lengths), args.max_duration,
                         args.deadline, probe=probe_plan)
    except ValueError as exc:
        parser.error(f"--concurrency and --lengths take comma lists of positive integers ({exc})")
    if args.probe_streams < 1 or args.probe_count < 1:
        parser.error("--probe-streams and --probe-count must be at least 1")
    if args.output_len < 1 or not 0 < args.max_duration <= args.deadline < math.inf:
        parser.error("--output-len must be at least 1, and 0 < --max-duration <= --deadline (seconds)")
    return args


def _ints(text: str) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(",") if v.strip())
    if any(v < 1 for v in values):
        raise ValueError("values must be at least 1")
    return values


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    for name in (__name__, "bench.peers", "bench.serve", "bench.probe"):
        logging.getLogger(name).setLevel(logging.INFO)
    if args.from_json:
        publish(Report.from_dict(json.loads(Path(args.from_json).read_text())), args, Path(args.from_json).parent)
        return
    started = time.monotonic()
    out_dir = Path(args.out_dir)
    configs = [CONFIGS[key] for key in args.configs.split(",")]
    if args.model:
        model_dir = str(prepared_model(args.model, EngineConfig().cache_dir))
        configs = [on_file(config, args.model) for config in configs]
    else:
        model_dir = serve_data.default_model_dir()
    tokenizer = serve_data.load_tokenizer(model_dir)
    machine = describe_machine(model_dir, args.model)
    results = [run_config(config, args.plan, tokenizer, model_dir, out_dir, not args.no_progress)
               for config in configs]
    elapsed = time.monotonic() - started
    command = shlex.join(["python", "-m", "bench", "compare", *(sys.argv[1:] if argv is None else argv)])
    report = Report(args.plan, results, machine, elapsed, command)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.json").write_text(json.dumps(report.as_dict(), indent=1))
    publish(report, args, out_dir)
    logger.info("compare: %d configurations in %.0f s (%s)", len(results), elapsed, out_dir / "compare.json")


def on_file(config: ServerConfig, gguf: str) -> ServerConfig:
    """`config` serving the GGUF file `gguf`: lockstep through LOCKSTEP_MODEL, llama-server on the file itself
    (its bfloat16 configurations have no such file: they say so and are skipped)."""
    if config.kind == "lockstep":
        return replace(config, settings=(("LOCKSTEP_MODEL", str(Path(gguf).resolve())), *config.settings))
    if config.kind == "llama-server":
        return replace(config, gguf=str(Path(gguf).resolve()) if config.gguf == "q4_1" else config.gguf + " of it")
    return config


def publish(report: Report, args, out_dir: Path) -> None:
    """The table on the terminal, the plot, and with --docs the Markdown section."""
    plot_path = Path(args.docs).parent / report.plot_name if args.docs else out_dir / "compare.png"
    report.plot(plot_path)
    logger.info("%s", report.terminal_text())
    if args.docs:
        report.write_docs(Path(args.docs), plot_path)


if __name__ == "__main__":
    main()

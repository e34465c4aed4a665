"""A GGUF's tensors as stored (4-bit blocks, float32 norms), with a copy kept as safetensors in the cache folder.

gguf-py's reader parses every metadata field (the embedded model's 49,152-token vocabulary and merges among them)
before it lists the tensors: about 6 s of each model worker's start on a 2-core host, and gguf-py's import pulls in
another second. The copy is written once, by the first reader (or `make model`), and read from then on in a
fraction of a second. It names the GGUF's size and modification time, so a reinstalled package is read again.
"""
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredTensor:
    type_name: str  # GGUF's type: Q4_1, Q8_0, F32, ...
    shape: tuple[int, ...]  # GGUF's order: the innermost dimension first
    data: np.ndarray  # as gguf-py gives it: the blocks' bytes (uint8) or the values


def read_tensors(gguf_path: str, copy_path: Path | None = None) -> dict[str, StoredTensor]:
    """Every tensor of `gguf_path`, from its copy at `copy_path` when that is current (writing it when not)."""
    source = _source_of(gguf_path)
    if copy_path is not None:
        tensors = _read_copy(copy_path, source)
        if tensors is not None:
            return tensors
    tensors = _read_gguf(gguf_path)
    if copy_path is not None:
        _write_copy(copy_path, tensors, source)
    return tensors


def _source_of(gguf_path: str) -> str:
    stat = os.stat(gguf_path)
    return f"{Path(gguf_path).name}:{stat.st_size}:{stat.st_mtime_ns}"


def _read_gguf(gguf_path: str) -> dict[str, StoredTensor]:
    from gguf import GGUFReader

    return {tensor.name: StoredTensor(tensor.tensor_type.name, tuple(int(d) for d in tensor.shape),
                                      np.asarray(tensor.data))
            for tensor in GGUFReader(gguf_path).tensors}


def _read_copy(copy_path: Path, source: str) -> dict[str, StoredTensor] | None:
    """The copy's tensors, or None when there is none, it is of another GGUF, or it cannot be read."""
    from safetensors import SafetensorError, safe_open

    if not copy_path.exists():
        return None
    try:
        with safe_open(str(copy_path), framework="numpy") as stored:
            metadata = stored.metadata() or {}
            if metadata.get("source") != source:
                logger.info("%s is of another GGUF (%s); reading %s", copy_path, metadata.get("source"), source)
                return None
            layout = json.loads(metadata["tensors"])
            return {name: StoredTensor(type_name, tuple(shape), stored.get_tensor(name))
                    for name, (type_name, shape) in layout.items()}
    except (OSError, SafetensorError, KeyError, TypeError, ValueError) as exc:  # ValueError: bad JSON too
        logger.warning("cannot read %s (%s); reading the GGUF", copy_path, exc)
        return None


def _write_copy(copy_path: Path, tensors: dict[str, StoredTensor], source: str) -> None:
    """Written under a temporary name and renamed: a reader never sees half a file, and two writers at once
    (two servers starting) leave one whole copy."""
    from safetensors.numpy import save_file

    layout = {name: [tensor.type_name, list(tensor.shape)] for name, tensor in tensors.items()}
    partial = copy_path.with_name(f"{copy_path.name}.{os.getpid()}.partial")
    try:
        copy_path.parent.mkdir(parents=True, exist_ok=True)
        save_file({name: np.ascontiguousarray(tensor.data) for name, tensor in tensors.items()}, str(partial),
                  metadata={"source": source, "tensors": json.dumps(layout)})
        os.replace(partial, copy_path)
        logger.info("kept the GGUF's tensors at %s", copy_path)
    except OSError as exc:  # a read-only cache: every start reads the GGUF instead
        if partial.exists():
            partial.unlink()
        logger.warning("cannot keep the GGUF's tensors at %s (%s)", copy_path, exc)

"""A GGUF's tensors as stored (4-bit blocks, float32 norms), with a copy kept as safetensors in the cache folder.

gguf-py's reader parses every metadata field (the embedded model's 49,152-token vocabulary and merges among them)
before it lists the tensors: about 6 s of each model worker's start on a 2-core host, and gguf-py's import pulls in
another second. The copy is written once, by the first reader (or `make model`), and read from then on in a
fraction of a second. It names the GGUF's size and modification time, so a reinstalled package is read again, and
carries a SHA-256 of every tensor's name, type, shape and bytes (0.07 s to check), so a copy cut short, altered
on disk or with another layout is read past and rewritten rather than failing every start.
"""
import hashlib
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


def _digest(tensors: dict[str, StoredTensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name]
        data = np.ascontiguousarray(tensor.data)
        digest.update(json.dumps([name, tensor.type_name, list(tensor.shape), str(data.dtype), data.shape]).encode())
        digest.update(memoryview(data).cast("B"))
    return digest.hexdigest()


def _read_copy(copy_path: Path, source: str) -> dict[str, StoredTensor] | None:
    """The copy's tensors, or None when there is none, it is of another GGUF, or it is not what was written."""
    from safetensors import SafetensorError, safe_open

    if not copy_path.is_file():  # not a FIFO either: opening one would block the start
        return None
    try:
        with safe_open(str(copy_path), framework="numpy") as stored:
            metadata = stored.metadata() or {}
            if metadata.get("source") != source:
                logger.info("%s is of another GGUF (%s); reading %s", copy_path, metadata.get("source"), source)
                return None
            layout = json.loads(metadata["tensors"])
            if not isinstance(layout, dict) or set(layout) != set(stored.keys()):
                raise ValueError("its layout does not list its tensors")
            tensors = {name: StoredTensor(type_name, tuple(shape), stored.get_tensor(name))
                       for name, (type_name, shape) in layout.items()}
    except (OSError, SafetensorError, KeyError, TypeError, ValueError) as exc:  # ValueError: bad JSON too
        logger.warning("cannot read %s (%s); reading the GGUF", copy_path, exc)
        return None
    if _digest(tensors) != metadata.get("digest"):
        logger.warning("%s is not the copy that was written (its digest differs or is missing); reading the GGUF",
                       copy_path)
        return None
    return tensors


def _write_copy(copy_path: Path, tensors: dict[str, StoredTensor], source: str) -> None:
    """Written under a temporary name and renamed: a reader never sees half a file, and two writers at once
    (two servers starting) leave one whole copy."""
    from safetensors import SafetensorError
    from safetensors.numpy import save_file

    layout = {name: [tensor.type_name, list(tensor.shape)] for name, tensor in tensors.items()}
    metadata = {"source": source, "tensors": json.dumps(layout), "digest": _digest(tensors)}
    partial = copy_path.with_name(f"{copy_path.name}.{os.getpid()}.partial")
    try:
        copy_path.parent.mkdir(parents=True, exist_ok=True)
        save_file({name: np.ascontiguousarray(tensor.data) for name, tensor in tensors.items()}, str(partial),
                  metadata=metadata)
        os.replace(partial, copy_path)
        logger.info("kept the GGUF's tensors at %s", copy_path)
    except (OSError, SafetensorError) as exc:  # a read-only or full cache: every start reads the GGUF instead
        if partial.is_file():
            partial.unlink()
        logger.warning("cannot keep the GGUF's tensors at %s (%s)", copy_path, exc)

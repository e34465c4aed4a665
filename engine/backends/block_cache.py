"""A GGUF's blocks repacked once, in the layout lockstep's 4-bit kernels read (block_repack.py, then interleaved by
8 rows where the kernels read that), kept in the cache folder and memory-mapped at every later start.

Repacking a 7-8 B file reads and rewrites about 5 GB; from the cache a start maps the file and the warm-up step
pages it in. Weights stay file-backed pages (the kernel can drop and re-read them under pressure) instead of a
second anonymous copy, and the first start holds one weight in memory at a time while it writes them. The cache
is keyed by the GGUF (path, size, modification time), the layout and BLOCK_CACHE_VERSION; it is written into a
folder of its own and renamed into place when complete, so a crash or two workers writing at once never leave a
half-written cache that a later start would read.
"""
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

BLOCK_CACHE_VERSION = 3  # raise when block_repack.py or the interleaved layout changes what is written (3: Q6_K)
ALIGNMENT = 64  # each weight starts on a cache line


class BlockCache:
    """`weight(name, make)`: the weight cached under `name`, or `make()`'s (laid out by `layout`) written first."""

    def __init__(self, cache_dir: str, gguf_path: str, layout: str, lay_out: Callable):
        path, stat = Path(gguf_path).resolve(), os.stat(gguf_path)
        self.key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}|{layout}|v{BLOCK_CACHE_VERSION}"
        # one prefix per file: a replaced file's cache is removed when the new one is in place
        self.prefix = f"{path.stem[:60]}-{_digest(str(path))}"
        self.folder = Path(cache_dir) / "blocks" / f"{self.prefix}-{_digest(self.key)}"
        self.lay_out = lay_out
        self.index = self._read_index(self.folder)
        self.writing = self.index is None
        if self.writing:
            self._remove_abandoned()
            self.target = self.folder.with_name(f"{self.folder.name}.{os.getpid()}.partial")
            shutil.rmtree(self.target, ignore_errors=True)
            self.target.mkdir(parents=True)
            self.index, self.size = {}, 0
            logger.info("repacking the GGUF's blocks once into %s", self.folder)
        else:
            self.target = self.folder
            self.size = (self.folder / "blocks.bin").stat().st_size

    def weight(self, name: str, make: Callable):
        from .q4 import QuantizedWeight

        if not self.writing:
            entry = self.index.get(name)
            if entry is None:
                raise ValueError(f"the block cache {self.folder} holds no {name}")
        else:
            weight = self.lay_out(make())
            entry = self._append(name, weight)
        blocks = np.memmap(self.target / "blocks.bin", dtype=np.uint8, mode="c", offset=entry["offset"],
                           shape=(entry["out_features"], entry["row_bytes"]))
        return QuantizedWeight(torch.from_numpy(blocks), entry["format"], entry["out_features"],
                               entry["in_features"])

    def commit(self) -> None:
        """Put a cache just written in place (another worker's, written meanwhile, is as good: ours is dropped)."""
        if not self.writing:
            return
        (self.target / "index.json").write_text(json.dumps({"key": self.key, "weights": self.index}))
        if self.folder.exists() and self._read_index(self.folder) is None:  # a broken one (its index lost)
            shutil.rmtree(self.folder, ignore_errors=True)
        try:
            os.replace(self.target, self.folder)
        except OSError:  # another process's cache is in place (a non-empty folder is not replaced)
            shutil.rmtree(self.target, ignore_errors=True)  # our mappings stay valid: the pages outlive the name
        self.writing = False
        logger.info("%.0f MB of blocks cached in %s", self.size / 2**20, self.folder)
        for older in self.folder.parent.glob(f"{self.prefix}-*"):
            if older != self.folder and not older.name.endswith(".partial") and self._read_index(older) is None:
                shutil.rmtree(older, ignore_errors=True)  # the file's earlier contents' (another key)

    def abandon(self) -> None:
        """A write that failed (a full disk, a bad tensor): its partial folder goes."""
        if self.writing:
            shutil.rmtree(self.target, ignore_errors=True)
            self.writing = False

    def _remove_abandoned(self) -> None:
        """Partial folders of this file whose writer is gone (killed mid-write: 5 GB each for a 7 B file)."""
        for partial in self.folder.parent.glob(f"{self.prefix}-*.partial"):
            try:
                os.kill(int(partial.name.rsplit(".", 2)[-2]), 0)
            except ProcessLookupError:
                shutil.rmtree(partial, ignore_errors=True)
            except (ValueError, PermissionError):  # not our naming, or another user's live process
                pass

    def _append(self, name: str, weight) -> dict:
        data = weight.blocks.numpy()
        offset = -(-self.size // ALIGNMENT) * ALIGNMENT
        with open(self.target / "blocks.bin", "ab") as out:
            out.write(b"\0" * (offset - self.size))
            out.write(memoryview(np.ascontiguousarray(data)))
        self.size = offset + data.nbytes
        entry = {"offset": offset, "format": weight.format, "out_features": weight.out_features,
                 "in_features": weight.in_features, "row_bytes": data.shape[1]}
        self.index[name] = entry
        return entry

    def _read_index(self, folder: Path) -> dict | None:
        try:
            index = json.loads((folder / "index.json").read_text())
            size = (folder / "blocks.bin").stat().st_size
        except (OSError, ValueError):
            return None
        weights = index.get("weights") if isinstance(index, dict) and index.get("key") == self.key else None
        try:
            if isinstance(weights, dict) and all(
                    entry["offset"] + entry["out_features"] * entry["row_bytes"] <= size for entry in weights.values()):
                return weights
        except (KeyError, TypeError):
            pass
        return None


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]

"""lockstep's C kernel for bfloat16 matmuls on one CPU core (bf16_linear.c), built on first use with the system's
C compiler into the cache folder and loaded with ctypes.

It is used only where it can run and computes what it should: an x86 CPU with AVX512-BF16, a C compiler, and a
probe against float64 when it loads. Otherwise `load_bf16_kernel` says why in the log and returns None, and the
fast forward keeps oneDNN's matmul. Nothing here runs at import time.
"""
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("bf16_linear.c")
COMPILE_FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-shared", "-fPIC")
CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})  # what those flags let it execute
COMPILE_TIMEOUT_S = 120
PROBE_ROWS = 33


class Bf16Kernel:
    """`pack` a weight [N, K] once, then `linear(x, packed)` computes x @ weight.T, bfloat16 in and out."""

    def __init__(self, library: ctypes.CDLL):
        self._linear = library.lockstep_bf16_linear
        self._linear.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
        self._linear.restype = None
        self.columns_per_block = library.lockstep_bf16_columns_per_block()

    def supports(self, weight: torch.Tensor) -> bool:
        return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
                and weight.shape[0] % self.columns_per_block == 0 and weight.shape[1] % 2 == 0)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[N, K] -> [N / columns, K / 2, columns, 2]: the layout bf16_linear.c streams through."""
        rows, depth = weight.shape
        return (weight.detach().reshape(rows // self.columns_per_block, self.columns_per_block, depth // 2, 2)
                .permute(0, 2, 1, 3).contiguous())

    def linear(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        depth = packed.shape[1] * 2
        out_features = packed.shape[0] * self.columns_per_block
        rows = x.reshape(-1, depth).contiguous()
        if rows.dtype != torch.bfloat16 or rows.device.type != "cpu":
            raise ValueError(f"bf16_linear takes bfloat16 CPU inputs, not {rows.dtype} on {rows.device}")
        out = torch.empty((rows.shape[0], out_features), dtype=torch.bfloat16)
        self._linear(rows.data_ptr(), packed.data_ptr(), out.data_ptr(), rows.shape[0], out_features, depth)
        return out.view(*x.shape[:-1], out_features)

    def computes_correctly(self) -> bool:
        """A probe: within bfloat16's rounding of the float64 result, and each row the same alone as among
        others (the property the engine's batch invariance rests on)."""
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(2 * self.columns_per_block, 160, generator=generator).to(torch.bfloat16)
        x = torch.randn(PROBE_ROWS, 160, generator=generator).to(torch.bfloat16)
        packed = self.pack(weight)
        together = self.linear(x, packed)
        exact = x.double() @ weight.double().T
        bound = exact.abs() * 2 ** -8 + (x.double().abs() @ weight.double().abs().T) * 2 ** -20
        close = bool(((together.double() - exact).abs() <= bound).all())
        alone = all(torch.equal(self.linear(x[row:row + 1], packed), together[row:row + 1])
                    for row in range(PROBE_ROWS))
        return close and alone


def load_bf16_kernel(cache_dir: str) -> Bf16Kernel | None:
    """The kernel, built into `cache_dir`/kernels if it is not there yet; None (and why, in the log) where it
    cannot run here."""
    missing = CPU_FLAGS - _cpu_flags()
    if missing:
        logger.info("bf16 matmul kernel: this CPU lacks %s; oneDNN's matmul", ", ".join(sorted(missing)))
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("bf16 matmul kernel: no C compiler (cc, gcc or $CC); oneDNN's matmul")
        return None
    try:
        library = ctypes.CDLL(str(_built_library(Path(cache_dir) / "kernels", compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("bf16 matmul kernel: could not build or load it (%s); oneDNN's matmul", exc)
        return None
    kernel = Bf16Kernel(library)
    if not kernel.computes_correctly():
        logger.warning("bf16 matmul kernel: its probe computed wrong numbers; oneDNN's matmul")
        return None
    return kernel


def _built_library(folder: Path, compiler: str) -> Path:
    """One file per source and flags; built into a temporary name and renamed, so processes that build at
    once (gunicorn workers, tests) never load a half-written file."""
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join((compiler, *COMPILE_FLAGS)).encode()).hexdigest()[:16]
    target = folder / f"bf16_linear-{digest}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as building:
        built = Path(building) / target.name
        done = subprocess.run([compiler, *COMPILE_FLAGS, str(SOURCE), "-o", str(built)], capture_output=True,
                              text=True, timeout=COMPILE_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise OSError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(built, target)
    logger.info("bf16 matmul kernel built: %s", target)
    return target


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()

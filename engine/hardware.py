"""What this machine can compute with, and the choices that follow from it (dtype, weight format), with the reason
for each. Read from /proc/cpuinfo and the CUDA driver's device node: no torch, so the parent may call it before
the fork. Torch's own idea of the CPU (`torch.backends.cpu.get_cpu_capability`, which ATEN_CPU_CAPABILITY lowers)
is asked in the worker only."""
import os
import platform
from dataclasses import dataclass
from functools import lru_cache

# The instruction sets that change what is fast, in the order a host is named by its best one.
ISA_FLAGS = (("AMX-BF16", {"amx_bf16"}), ("AVX512-BF16", {"avx512_bf16"}), ("AVX-512", {"avx512f"}),
             ("AVX2+FMA", {"avx2", "fma"}), ("NEON", {"asimd"}))
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86's, and ARM's (Features: bf16)
CAPABILITY_MASK_ENV = "LOCKSTEP_CPU_FLAGS_MASK"  # flags to hide (comma-separated): test a lesser host's path


@dataclass(frozen=True)
class Host:
    arch: str
    flags: frozenset[str]
    num_cores: int
    has_cuda: bool

    @property
    def isa(self) -> str:
        """The best instruction set that matters here, e.g. "AVX2+FMA"."""
        return next((name for name, needed in ISA_FLAGS if needed <= self.flags), "baseline")

    @property
    def has_native_bf16(self) -> bool:
        return bool(NATIVE_BF16_FLAGS & self.flags)

    def describe(self) -> str:
        return f"{self.arch} {self.isa}, {self.num_cores} cores" + (", CUDA" if self.has_cuda else "")


@lru_cache(maxsize=1)
def machine_cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (x86 `flags`, ARM `Features`) as /proc/cpuinfo lists them, whatever the mask hides."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                key = line.split(":", 1)[0].strip()
                if key in ("flags", "Features"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_flags() -> frozenset[str]:
    """The flags lockstep chooses its compute by: the CPU's, less any named in LOCKSTEP_CPU_FLAGS_MASK."""
    masked = {flag.strip() for flag in os.environ.get(CAPABILITY_MASK_ENV, "").split(",") if flag.strip()}
    return machine_cpu_flags() - masked


def detect_host() -> Host:
    has_cuda = os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")
    return Host(platform.machine(), cpu_flags(), available_cores(), has_cuda)


def available_cores() -> int:
    """The cores this process may run on (its affinity: a container's or taskset's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def torch_threads(wanted: int, host: Host) -> tuple[int, str]:
    """(torch threads, why fewer than wanted). PyPI's aarch64 torch 2.13.0 computes a float64 GEMM on several threads
    with ARMv8.1's atomics (LSE: `ldaddal` in its NVPL BLAS), which an ARMv8.0 core (Cortex-A72 as in the Raspberry
    Pi 4, A53, A57, AWS Graviton 1) does not have: the process dies of SIGILL (the 4-bit kernels' probe computes its
    reference in float64). One torch thread there; lockstep's kernels keep their own helper threads. Where the flags
    are unknown (no /proc/cpuinfo, as on macOS), as wanted."""
    if host.arch in ("aarch64", "arm64") and host.flags and "atomics" not in host.flags and wanted > 1:
        return 1, "an ARMv8.0 CPU (no LSE atomics), where torch's threaded float64 BLAS dies of SIGILL"
    return wanted, ""


def choose_dtype(configured: str, device: str, host: Host) -> tuple[str, str]:
    """(dtype, why). `auto`: bfloat16 where the hardware computes it (a GPU, AVX512-BF16, AMX, ARM's BF16), else
    float32: emulated bfloat16 is slower than float32 (AVX2: a decode step's matmuls 8-20x slower)."""
    if configured != "auto":
        return configured, f"configured: {configured}"
    if device == "cuda" or (device == "auto" and host.has_cuda):
        return "bfloat16", "auto: a CUDA GPU computes bfloat16"
    if host.has_native_bf16:
        return "bfloat16", f"auto: this CPU computes bfloat16 ({host.isa})"
    return "float32", f"auto: this CPU has no bfloat16 instructions ({host.isa}), so bfloat16 would be emulated"

"""What this machine can compute with, and the choices that follow from it (dtype, weight format), with the reason
for each. Read from /proc/cpuinfo, the process's affinity, its cgroups' CPU quota and memory limits, /proc/meminfo and
the CUDA driver's device node: no torch, so the parent may call it before the fork. Torch's own idea of the CPU
(`torch.backends.cpu.get_cpu_capability`, which ATEN_CPU_CAPABILITY lowers) is asked in the worker only."""
import os
import platform
import re
from dataclasses import dataclass
from functools import lru_cache

# The instruction sets that change what is fast, in the order a host is named by its best one.
ISA_FLAGS = (("AMX-BF16", {"amx_bf16"}), ("AVX512-BF16", {"avx512_bf16"}), ("AVX-512", {"avx512f"}),
             ("AVX2+FMA", {"avx2", "fma"}), ("NEON", {"asimd"}))
NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86's, and ARM's (Features: bf16)
CAPABILITY_MASK_ENV = "LOCKSTEP_CPU_FLAGS_MASK"  # flags to hide (comma-separated): test a lesser host's path
NO_MEMORY_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as the largest page count in bytes (9223372036854771712)


@dataclass(frozen=True)
class Host:
    arch: str
    flags: frozenset[str]
    num_cores: int
    has_cuda: bool
    cpu_quota: float | None = None  # a cgroup's CPU limit, which num_cores already keeps to

    @property
    def isa(self) -> str:
        """The best instruction set that matters here, e.g. "AVX2+FMA"."""
        return next((name for name, needed in ISA_FLAGS if needed <= self.flags), "baseline")

    @property
    def has_native_bf16(self) -> bool:
        return bool(NATIVE_BF16_FLAGS & self.flags)

    def describe(self) -> str:
        quota = f" (a cgroup CPU quota of {self.cpu_quota:g})" if self.cpu_quota is not None else ""
        return f"{self.arch} {self.isa}, {self.num_cores} cores{quota}" + (", CUDA" if self.has_cuda else "")


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
    return Host(platform.machine(), cpu_flags(), available_cores(), has_cuda, cpu_quota())


def available_cores() -> int:
    """The cores this process may compute on: those its affinity allows, within its cgroup's CPU quota
    (`cores_within`)."""
    return cores_within(affinity_cores(), cpu_quota())


def affinity_cores() -> int:
    """The cores this process may run on (its affinity: a cpuset's or taskset's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cores_within(cores: int, quota: float | None) -> int:
    """No more threads than a CPU quota's whole CPUs (a container's `--cpus`, a Kubernetes CPU limit), at least one:
    threads beyond it only wait out throttled periods, and a fraction rounds down (measured in docs/benchmarks.md,
    "Measurements behind the code's constants")."""
    return max(1, min(cores, int(quota))) if quota is not None else cores


@lru_cache(maxsize=None)
def cpu_quota(proc: str = "/proc/self") -> float | None:
    """CPUs' worth of time per period this process's cgroups allow (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` over
    `cpu.cfs_period_us`), the least along its path up to the hierarchy's root; None where nothing limits it."""
    limits = [limit for cgroup in cgroups("cpu", proc) for limit in cgroup.cpu_quotas()]
    return min(limits) if limits else None


@dataclass(frozen=True)
class Cgroup:
    """This process's cgroup in one mounted hierarchy."""
    directory: str
    mount_point: str  # the hierarchy's root as this process sees it
    version: int  # 1 or 2

    def cpu_quotas(self) -> list[float]:
        """The CPU quotas set from this cgroup up to the mount point (a parent's limit holds for its children too)."""
        return [quota for directory in self.levels() if (quota := self._quota_in(directory)) is not None]

    def memory_headrooms(self) -> list[int]:
        """What each memory limit from this cgroup up to the mount point leaves (a parent's holds its children too)."""
        return [room for directory in self.levels() if (room := self._headroom_in(directory)) is not None]

    def levels(self) -> list[str]:
        """This cgroup's directory and its parents' up to the mount point."""
        directories = [self.directory]
        while len(directories[-1]) > len(self.mount_point):
            directories.append(os.path.dirname(directories[-1]))
        return directories

    def _quota_in(self, directory: str) -> float | None:
        try:
            if self.version == 2:
                quota, period = (_read(directory, "cpu.max").split() + ["100000"])[:2]
            else:
                quota, period = _read(directory, "cpu.cfs_quota_us"), _read(directory, "cpu.cfs_period_us")
            return None if quota in ("max", "-1") or int(period) <= 0 else int(quota) / int(period)
        except (OSError, ValueError, OverflowError):  # no such file at this level, not a number, or an absurd one
            return None

    def _headroom_in(self, directory: str) -> int | None:
        """The limit less the working set (usage less inactive file pages, which the kernel drops before it kills
        anything: what `docker stats` and the kubelet count); v2's `memory.high` (throttling) counts as a limit too."""
        names = ("memory.max", "memory.high", "memory.current") if self.version == 2 else \
            ("memory.limit_in_bytes", "memory.usage_in_bytes")
        limits = [limit for name in names[:-1] if (limit := _bytes(directory, name)) is not None]
        usage = _bytes(directory, names[-1])
        if not limits or usage is None:  # no limit at this level, or none this process may read
            return None
        # v1's total_inactive_file: the hierarchy's, as its usage is
        inactive = _stat(directory, "inactive_file" if self.version == 2 else "total_inactive_file")
        return max(0, min(limits) - max(0, usage - inactive))


def cgroups(controller: str, proc: str = "/proc/self") -> list[Cgroup]:
    """Where this process sits in each mounted cgroup hierarchy that may hold `controller` (v2's unified one, and
    v1's with that controller), from /proc/self/cgroup and /proc/self/mountinfo."""
    try:
        paths = dict(_cgroup_path(line, controller) for line in _read(proc, "cgroup").splitlines()
                     if line.count(":") >= 2)
        mounts = [line.split() for line in _read(proc, "mountinfo").splitlines()]
    except (OSError, ValueError):  # unreadable, or not text
        return []
    found = []
    for fields in mounts:
        if len(fields) < 10 or "-" not in fields[6:-2]:  # id parent dev root mount options [tags] - type source super
            continue
        root, mount_point = _unescape(fields[3]), _unescape(fields[4])
        fs_type, super_options = fields[fields.index("-") + 1], fields[-1].split(",")
        version = 2 if fs_type == "cgroup2" else 1 if fs_type == "cgroup" and controller in super_options else 0
        path = paths.get("" if version == 2 else controller)
        if not version or not path:
            continue
        # a path outside the mount's root (a container's view of a host cgroup, `/..` outside a namespace's root):
        # the mount is this cgroup
        inside = (path == root or path.startswith(root.rstrip("/") + "/")) and ".." not in path.split("/")
        relative = path[len(root.rstrip("/")):].lstrip("/") if inside else ""
        found.append(Cgroup(os.path.join(mount_point, relative).rstrip("/") or "/", mount_point.rstrip("/") or "/",
                            version))
    return found


def _unescape(field: str) -> str:
    """mountinfo writes a space, tab, newline or backslash in a path as \\NNN (octal)."""
    return re.sub(r"\\([0-7]{3})", lambda escaped: chr(int(escaped.group(1), 8)), field)


def _cgroup_path(line: str, controller: str) -> tuple[str, str]:
    """A /proc/self/cgroup line `id:controllers:path` as (controller, path): "" for v2's unified hierarchy,
    `controller` for the v1 hierarchy that has it, else its controllers."""
    _, controllers, path = line.split(":", 2)
    return (controller if controller in controllers.split(",") else controllers), path


def _bytes(directory: str, name: str) -> int | None:
    """A cgroup's memory file as bytes; None for "max", v1's no-limit value, a missing or unreadable file."""
    try:
        value = _read(directory, name)
        number = None if value == "max" else int(value)
    except (OSError, ValueError):
        return None
    return number if number is not None and number < NO_MEMORY_LIMIT else None


def _stat(directory: str, key: str) -> int:
    """One counter of a cgroup's `memory.stat` (0 where it or the file is missing: only what can be dropped)."""
    try:
        lines = _read(directory, "memory.stat").splitlines()
    except OSError:
        return 0
    for line in lines:
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def memory_headroom(proc: str = "/proc/self", meminfo: str = "/proc/meminfo", mapped: int = 0) -> int | None:
    """Bytes this process's server may still take before the kernel kills one of its processes: the least of what its
    cgroups' memory limits leave (a container's `--memory`, a Kubernetes memory limit) and the machine's
    MemAvailable; None where neither is known. Read when asked: it changes as the server grows. `mapped`: bytes of
    mapped files that must stay resident (the model's weights): MemAvailable counts their pages as page cache the
    kernel could drop, a cgroup's working set already holds them (active file pages)."""
    rooms = [room for cgroup in cgroups("memory", proc) for room in cgroup.memory_headrooms()]
    try:
        available = next(int(line.split()[1]) * 1024 for line in _read(*os.path.split(meminfo)).splitlines()
                         if line.startswith("MemAvailable:"))
        rooms.append(max(0, available - mapped))
    except (OSError, ValueError, IndexError, StopIteration):  # not Linux, or a kernel older than 3.14
        pass
    return min(rooms) if rooms else None


def _read(directory: str, name: str) -> str:
    with open(os.path.join(directory, name), encoding="utf-8", errors="surrogateescape") as file:  # paths: bytes
        return file.read().strip()


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

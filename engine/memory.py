"""Handing freed memory back to the OS (glibc only; elsewhere these do nothing).

glibc keeps freed heap pages, and each thread may get an arena of its own: a burst of long prompts
(tokenized in request threads, or as KV cache in the worker) would leave a process at its peak for good.
"""
import ctypes
import ctypes.util
import functools

M_ARENA_MAX = -8  # mallopt's parameter numbers
M_MMAP_THRESHOLD = -3
# Allocations from this size on are mapped on their own and unmapped when freed. glibc's default threshold rises to
# the largest block freed (up to 32 MB), after which a prompt chunk's activations and a regrown cache come from the
# heap and stay resident when freed. Measured with the model worker under 16 prompts of 1,500 tokens (KV budget 5,400
# positions): the whole server's working set peaked at 765 / 766 MB against 785 / 783 with glibc's default (the
# worker's trims after prompt steps do the rest); 256 KiB cost up to a third of the tokens/s at 16 clients (per-step
# buffers mapped afresh each step), 4 MiB nothing measurable (docs/benchmarks.md).
MMAP_THRESHOLD_BYTES = 4 << 20


def release_freed_memory() -> None:
    """Return freed heap pages to the OS (cheap: well under a millisecond at our heap sizes)."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


def limit_malloc_arenas(num_arenas: int) -> None:
    """Cap glibc's arenas (8 per core by default): call it before the threads that allocate start."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is not None:
        mallopt(M_ARENA_MAX, num_arenas)


def unmap_large_blocks_when_freed(threshold: int = MMAP_THRESHOLD_BYTES) -> None:
    """A fixed mmap threshold (see MMAP_THRESHOLD_BYTES); a fork inherits it."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, threshold)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")

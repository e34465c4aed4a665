"""Handing freed memory back to the OS (glibc only; elsewhere these do nothing).

glibc keeps freed heap pages, and each thread may get an arena of its own: a burst of long prompts
(tokenized in request threads, or as KV cache in the worker) would leave a process at its peak for good.
"""
import ctypes
import ctypes.util
import functools

M_ARENA_MAX = -8  # mallopt's parameter number


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


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")

"""The C library's ``malloc``, tuned for a worker and trimmed after large drops (glibc only; elsewhere a no-op).

Workers keep freed blocks below an mmap threshold in their heap
(:func:`tune`), so a step's buffers are not faulted in afresh each time.
The price: a block freed in the middle of the heap, below one still in use,
is never returned to the system. A parameter server that drops a large
model would keep its memory for good; :func:`trim` gives the free pages
back (``malloc_trim``), and the server calls it once it has dropped more
than :data:`TRIM_AFTER` bytes since it last did.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters
TRIM_AFTER = 64 << 20  # bytes of variables, slots and blobs a server drops before it trims its heap


@functools.cache
def _libc() -> Any:
    """glibc, or ``None`` where the C library is another (musl has no ``mallopt``) or this is not Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (both, or neither is used)
    except (OSError, AttributeError):
        return None
    return libc


def tune(size: int) -> bool:
    """Serve blocks below ``size`` bytes from one heap shared by every thread, keeping up to twice that
    free at its top; whether it was set (not for ``size <= 0``, nor without glibc)."""
    libc = _libc()
    if size <= 0 or libc is None:
        return False
    trim_at = min(2 * size, 2**31 - 1)
    return (bool(libc.mallopt(M_ARENA_MAX, ctypes.c_int(1))) and bool(libc.mallopt(M_MMAP_THRESHOLD, ctypes.c_int(size)))
            and bool(libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(trim_at))))


def trim() -> bool:
    """Return the heap's free pages to the system; whether any were (``False`` without glibc)."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(ctypes.c_size_t(0)))

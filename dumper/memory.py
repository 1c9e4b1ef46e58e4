"""Giving freed memory back to the system.

Snapshots of a large step are freed once written, but glibc's allocator keeps freed heap pages
for reuse: the process would stay larger by about a step's snapshots for the rest of the run.
``malloc_trim(0)`` returns them.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Callable, Optional


@functools.lru_cache(maxsize=None)
def _malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's ``malloc_trim``, or None where the C library has none (musl, macOS, Windows)."""
    try:
        return ctypes.CDLL(None).malloc_trim  # the symbols the process has loaded
    except (OSError, AttributeError, TypeError):
        return None


def trim_heap() -> bool:
    """Return the C heap's free pages to the system; whether it could (glibc only)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True

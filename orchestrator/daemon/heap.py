"""Handing freed heap memory back to the operating system.

The daemon allocates and frees many small objects per rollout (request bodies, parsed
answers, segments), in the event loop's thread and in worker threads. glibc's malloc
keeps what they free in its arenas (a worker thread may get an arena of its own) and
returns it to the system only from the top of a heap: over a long run, RSS creeps up
while the live objects do not grow (docs/benchmarks.md, the memory soak).
`malloc_trim(0)` gives every whole free page of every arena back. The daemon calls it
after each collection, in a worker thread: it takes a few milliseconds, once per policy
version. Where the C library has no `malloc_trim` (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        # The process's own symbols, which include the C library's.
        function = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_size_t]
    function.restype = ctypes.c_int
    trim: Callable[[int], int] = function
    return trim


def trim_heap() -> bool:
    """Return free heap pages to the system. Blocking (milliseconds). True when the C
    library has `malloc_trim` and it released memory."""
    trim = _malloc_trim()
    return trim is not None and trim(0) == 1

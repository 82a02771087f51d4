"""trim_heap gives freed heap pages back to the system (where the C library can)."""

from __future__ import annotations

import platform

import pytest

from orchestrator.daemon.heap import trim_heap


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="malloc_trim is glibc's",
)
def test_freed_fragmented_heap_memory_goes_back_to_the_system() -> None:
    # 2 KiB objects come from malloc's heap (not Python's small-object arenas, not mmap);
    # keeping every 64th one pins the heap's top, so nothing is returned on its own.
    blocks = [bytes(2048) for _ in range(64 * 1024)]
    kept = blocks[::64]
    del blocks
    before = rss_bytes()
    assert trim_heap() is True
    assert before - rss_bytes() > 32 * 2**20
    assert len(kept) == 1024

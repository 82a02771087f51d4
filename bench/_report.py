"""Shared by the benchmark scripts: the machine's description and docs/benchmarks.md sections.

Each benchmark owns one section of docs/benchmarks.md, delimited by HTML comment markers,
and rewrites only that section, so benchmarks can be run one at a time or all together.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = (
    "# Benchmarks\n\n"
    "Written by `make bench` (each script rewrites only its own section). Figures are from\n"
    "one run on the machine each section names; ratios are measured within one run so they\n"
    "hold on a noisy machine. These are measurements, not tests.\n"
)


def machine() -> str:
    """One line describing this machine: CPU model, cores, memory, Python, kernel."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores{mem}, Python {platform.python_version()}, "
        f"{platform.system()} {platform.release()}"
    )


def git_revision() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def write_section(name: str, markdown: str) -> None:
    """Replace (or append) the section `name` of docs/benchmarks.md with `markdown`."""
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n{markdown.rstrip()}\n{end}"
    text = DOC.read_text() if DOC.exists() else HEADER
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text)

"""Every module path a comment, docstring or document cites exists.

A path such as ``orchestrator/core/payload_refs.py`` or ``payload_gc/_plan.py`` written
into a comment outlives the module when it moves; this test finds such citations in the
sources, tests, benchmarks and documents, and names each one whose file is gone. Paths
are cited from the repository's root (``payload_gc/...`` also from ``payload-gc/``), optionally
followed by ``:<line>``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Where citations are looked for: folders (their ``*.py``, ``*.md`` and ``*.toml``
#: files) and single files.
SCANNED_DIRS = ("orchestrator", "gc", "bench", "tests", "docs")
SCANNED_FILES = ("README.md", "pyproject.toml", "Makefile")
SUFFIXES = frozenset({".py", ".md", ".toml"})

# A path starts a word (not the tail of a longer path such as /tmp/x/orchestrator/a.py)
# and is spelled with word characters, dots, dashes and slashes only, so that a pattern
# such as `orchestrator/payload/_*.py` is no citation.
_CITATION = re.compile(
    r"(?<![\w/.-])((?:payload-gc/)?payload_gc|orchestrator)(/[\w./-]*?)?/[\w.-]+\.py\b"
)


def scanned_files() -> Iterator[Path]:
    """The files whose text is searched for citations."""
    for folder in SCANNED_DIRS:
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix in SUFFIXES and path.is_file() and ".venv" not in path.parts:
                yield path
    for name in SCANNED_FILES:
        path = REPO / name
        if path.is_file():
            yield path


def cited_paths(text: str) -> Iterator[tuple[int, str]]:
    """Each ``(line number, path)`` cited in `text`."""
    for number, line in enumerate(text.splitlines(), 1):
        for match in _CITATION.finditer(line):
            yield number, match.group(0)


def exists(cited: str) -> bool:
    """Whether the cited path names a file of the repository."""
    if cited.startswith("payload_gc/"):
        cited = f"payload-gc/{cited}"
    return (REPO / cited).is_file()


def test_the_citation_pattern() -> None:
    text = (
        "see orchestrator/core/payload_refs.py:31 and `payload_gc/_plan.py`,\n"
        "(payload-gc/payload_gc/_busy.py) but not /tmp/orchestrator/a.py, "
        "orchestrator/payload/_*.py\n"
        "nor orchestrator.json or orchestrator/handoff/primerl/\n"
    )
    assert list(cited_paths(text)) == [
        (1, "orchestrator/core/payload_refs.py"),
        (1, "payload_gc/_plan.py"),
        (2, "payload-gc/payload_gc/_busy.py"),
    ]
    assert exists("orchestrator/core/payload_refs.py")
    assert exists("payload_gc/_plan.py")
    assert not exists("orchestrator/payload_refs.py")


def test_every_cited_module_path_exists() -> None:
    missing = [
        f"{path.relative_to(REPO)}:{number}: {cited}"
        for path in scanned_files()
        for number, cited in cited_paths(path.read_text(encoding="utf-8", errors="replace"))
        if path != Path(__file__).resolve() and not exists(cited)
    ]
    assert not missing, "cited module paths that do not exist:\n" + "\n".join(missing)

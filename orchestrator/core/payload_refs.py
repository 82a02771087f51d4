"""Reference counts of payload files: which files a queued or shipped sample still needs.

The sink decides when a discarded sample's payload files may be deleted (docs/design.md §6): a file
is safe to delete once no queued sample holds it and no shipped sample references it.
Branches of one rollout share files (every branch reads the turns before it forked), so
a file is deleted with the last sample that holds it, not with the first.

Two kinds of reference:

* a *hold* is counted: one per queued sample whose `files` contain the path. It goes away
  when that sample ships or is discarded.
* a *pin* is a mark: a shipped sample references the file. Only the version collector
  deletes such a file (with its whole `<root>/v<k>/` directory), so a pinned file is never
  reported as deletable. Pins are dropped per version directory once the collector has
  removed it (`drop_versions_below`), which keeps memory bounded over a long run.

Pure bookkeeping: nothing here touches the filesystem.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import attrs
from payload_gc import parse_version


def _parent_dir(path: str) -> str:
    # String work, not pathlib: this runs for every file of every group admitted (pathlib
    # made it the sink's main cost). Only consistency matters: pins are stored and looked
    # up under the same key, and `drop_versions_below` reads the key's last component.
    return path.rpartition("/")[0]


@attrs.define
class PayloadRefs:
    """Holds and pins of payload files (absolute paths inside `<root>/v<k>/`)."""

    # path -> number of queued samples holding it; a path leaves when its count hits zero.
    _holds: dict[str, int] = attrs.field(factory=dict, init=False)
    # parent directory (`<root>/v<k>`) -> pinned paths in it. Keyed by directory so that
    # everything the collector removed can be forgotten in one step per directory.
    _pinned: dict[str, set[str]] = attrs.field(factory=dict, init=False)

    @property
    def held_files(self) -> int:
        """The number of distinct files at least one queued sample holds."""
        return len(self._holds)

    @property
    def pinned_files(self) -> int:
        """The number of distinct files pinned by shipped samples and not yet forgotten."""
        return sum(len(paths) for paths in self._pinned.values())

    def hold(self, files: Iterable[str]) -> None:
        """Add one hold on each of `files` (a queued sample's files)."""
        for path in files:
            self._holds[path] = self._holds.get(path, 0) + 1

    def release(self, files: Iterable[str]) -> list[str]:
        """Remove one hold from each of `files`; return those now safe to delete.

        A file is returned when its last hold went away and it is not pinned. The result is
        in the order of `files`, each path once.

        Raises `ValueError`, before changing anything, if a file is released more often
        than it is held (a bookkeeping bug: deleting on it could remove a file a queued
        sample still needs).
        """
        releases = Counter(files)
        for path, times in releases.items():
            if self._holds.get(path, 0) < times:
                raise ValueError(f"payload file released more often than held: {path}")
        deletable = []
        for path, times in releases.items():
            remaining = self._holds[path] - times
            if remaining:
                self._holds[path] = remaining
                continue
            del self._holds[path]
            if not self.is_pinned(path):
                deletable.append(path)
        return deletable

    def pin(self, files: Iterable[str]) -> None:
        """Mark `files` as referenced by a shipped sample: never reported as deletable.

        Pinning does not release holds. To ship a queued sample, pin its files and then
        release its hold; in that order `release` returns none of them.
        """
        for path in files:
            self._pinned.setdefault(_parent_dir(path), set()).add(path)

    def is_pinned(self, path: str) -> bool:
        """Whether a shipped sample references `path` (and it has not been forgotten)."""
        return path in self._pinned.get(_parent_dir(path), ())

    def is_referenced(self, path: str) -> bool:
        """Whether a queued sample holds `path` or a shipped sample references it."""
        return path in self._holds or self.is_pinned(path)

    def orphans(self, files: Iterable[str]) -> list[str]:
        """Of `files`, those neither held nor pinned: safe to delete. In order, each once."""
        return [path for path in dict.fromkeys(files) if not self.is_referenced(path)]

    def drop_versions_below(self, bound: int) -> int:
        """Forget the pins of files in every `v<k>` directory with `k < bound`.

        Call it after the version collector removed those directories: their files are gone,
        so remembering them would only let memory grow with the run's length. Holds are
        not touched: they leave with their queued samples (the sweep drops such samples,
        and deleting a file the collector already removed is harmless). Directories not
        named `v<k>` are kept (payload files always live in one). Returns the number of
        pins forgotten.
        """
        dropped = 0
        for directory in list(self._pinned):
            version = parse_version(directory.rpartition("/")[2])
            if version is not None and version < bound:
                dropped += len(self._pinned.pop(directory))
        return dropped

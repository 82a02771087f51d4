"""The daemon's running account of the payload bytes on disk (docs/design.md §8).

Neither a collection nor anything else the daemon does walks the payload root: on a
network filesystem that does not cache attributes, a walk costs one round trip per file
kept. The daemon counts instead. A file enters the account when its group's files are
checked (`RolloutFinisher.check_files` stats each file a reply names: the size found on
disk, never the size a reply claims), and leaves it when a discard deletes it or when a collection
removes its version directory. Pure bookkeeping, no I/O.

What it does not see: files a server wrote that no checked reply names (a request cut
short, a group stopped as stale before its check), files on disk before this process
started (a resumed run), and busy files a deletion left (deleted while still open). The
first two are freed by the collection of their version, which ends them for the account
too; `orchestrator status` walks the root when asked.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import attrs
from payload_gc import parse_version


def payload_file_key(root: str, path: str) -> tuple[int, str] | None:
    """`(k, name)` for the path `<root>/v<k>/<name>` (as the daemon builds payload file
    paths), or `None` for any other path."""
    directory, _, name = path.rpartition("/")
    parent, _, version_dir = directory.rpartition("/")
    version = parse_version(version_dir)
    if parent != root or version is None or not name:
        return None
    return version, name


@attrs.define
class PayloadAccount:
    """The payload files known to be on disk, by version: each file's name and size.

    One entry per file (about as much as the sink keeps per file already), and only
    while the file is on disk: the account never grows with the length of a run.
    """

    _versions: dict[int, dict[str, int]] = attrs.field(factory=dict)
    files: int = 0
    bytes: int = 0

    def add(self, sizes: Mapping[tuple[int, str], int]) -> None:
        """Count the files `(version, name) -> size` found on disk (a file counted
        already is counted once, at its latest size)."""
        for (version, name), size in sizes.items():
            names = self._versions.setdefault(version, {})
            previous = names.get(name)
            if previous is None:
                self.files += 1
            else:
                self.bytes -= previous
            names[name] = size
            self.bytes += size

    def remove(self, keys: Iterable[tuple[int, str]]) -> tuple[int, int]:
        """Forget the files `(version, name)` (deleted); return the files and bytes that
        left the account. Files it never counted are ignored."""
        files = size = 0
        for version, name in keys:
            names = self._versions.get(version)
            if names is None:
                continue
            freed = names.pop(name, None)
            if freed is None:
                continue
            files += 1
            size += freed
            if not names:
                del self._versions[version]
        self.files -= files
        self.bytes -= size
        return files, size

    def remove_below(self, bound: int, *, keep: Iterable[int] = ()) -> tuple[int, int]:
        """Forget every file of the versions below `bound` (collected), but those of the
        versions in `keep`; return the files and bytes that left the account."""
        kept = set(keep)
        files = size = 0
        for version in [v for v in self._versions if v < bound and v not in kept]:
            names = self._versions.pop(version)
            files += len(names)
            size += sum(names.values())
        self.files -= files
        self.bytes -= size
        return files, size

    def versions(self) -> list[int]:
        """The versions holding counted files, in order."""
        return sorted(self._versions)

    def items(self) -> list[tuple[tuple[int, str], int]]:
        """Every counted file, `((version, name), size)`, in order."""
        return sorted(
            ((version, name), size)
            for version, names in self._versions.items()
            for name, size in names.items()
        )

"""The payload files the run wrote and deleted, and the running account of what is on
disk: written by the services that check, delete and collect files, read by the reports.

Its own module, below both `run_state` (which holds one) and `payload_files.disk` (which
records deletions in it), so that neither imports the other.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import attrs
from payload_gc import FileRemoval

from orchestrator.daemon.payload_files.account import PayloadAccount, payload_file_key

__all__ = ["PayloadLedger"]


@attrs.define
class PayloadLedger:
    """The payload files written and deleted, and the running account of what is on disk
    (no walk of the root: see orchestrator/daemon/payload_files/account.py)."""

    # Files and bytes deleted, by reason: "discard", "sweep", "collection", "wipe".
    files_deleted: Counter[str] = attrs.field(factory=Counter)
    bytes_deleted: Counter[str] = attrs.field(factory=Counter)
    files_written: int = 0
    bytes_written: int = 0
    # Bytes on disk by the account, and the most it ever held: its value right before a
    # collection, where disk use peaks.
    bytes: int = 0
    peak_bytes: int = 0
    account: PayloadAccount = attrs.field(factory=PayloadAccount)

    def record_written(
        self, sizes: Mapping[tuple[int, str], int], *, collected_below: int | None
    ) -> None:
        """Payload files a group's check found on disk, `(version, name) -> size`: counted
        as written, and entered in the account, except in versions already collected (a
        collection that ended while the check ran: those files are gone)."""
        self.files_written += len(sizes)
        self.bytes_written += sum(sizes.values())
        if collected_below is not None:
            sizes = {key: size for key, size in sizes.items() if key[0] >= collected_below}
        self.account.add(sizes)
        self._account_changed()

    def record_files_deleted(
        self, root: Path, paths: Iterable[str], removal: FileRemoval, *, reason: str
    ) -> None:
        """A discard or sweep (`reason`) was asked to delete `paths` (`<root>/v<k>/<name>`)
        and did what `removal` says: the files it deleted leave the account (those it
        left, in `removal.left`, stay)."""
        self.files_deleted[reason] += removal.files
        self.bytes_deleted[reason] += removal.bytes
        prefix = os.fspath(root)
        left = set(removal.left)
        keys = (payload_file_key(prefix, path) for path in paths)
        self.account.remove(key for key in keys if key is not None and key not in left)
        self._account_changed()

    def record_collected(
        self, bound: int, *, files: int = 0, bytes: int = 0, failed: Iterable[int] = ()
    ) -> None:
        """A collection removed every version below `bound` (`files` and `bytes` of
        them): their files leave the account (busy files it left behind included: they go
        once closed), except those of the `failed` versions, which it could not delete
        entirely (counted in full until a collection succeeds)."""
        self.files_deleted["collection"] += files
        self.bytes_deleted["collection"] += bytes
        self.account.remove_below(bound, keep=failed)
        self._account_changed()

    def record_measured(self, total: int) -> None:
        """A measured total (a walk of the root, as at the end of a run), which replaces
        the account's figure until the account next changes."""
        self.bytes = total
        self.peak_bytes = max(self.peak_bytes, total)

    def _account_changed(self) -> None:
        self.bytes = self.account.bytes
        self.peak_bytes = max(self.peak_bytes, self.bytes)

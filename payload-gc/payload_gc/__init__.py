"""payload_gc: delete versioned payload directories below a staleness bound, safely.

A payload root holds one directory per policy version, `<root>/v<k>/`. Once no unread
batch can reference version `k` any more (`k < min_fresh_version(s + 1, m)` after `v{s}`
is applied everywhere), `collect_below` deletes those directories without ever following
a link or leaving the root's filesystem, and without looking at the versions it keeps.
Busy files (deleted while still open: `.nfs<hex>`, `.fuse_hidden<hex>`) are left, and
their directories retried by the next collection. An entry that vanished meanwhile
(`is_vanished`: `ENOENT`, or `ESTALE` on NFS and FUSE mounts) counts as deleted.
`wipe_root` empties a root for a fresh run.
"""

from ._busy import is_busy_name
from ._collect import (
    BusyDir,
    CollectionError,
    CollectionReport,
    DeletedDir,
    collect_below,
    collect_below_sync,
)
from ._errors import LockHeld, PayloadGCError, RootMissing, RootRefused
from ._plan import (
    CollectionPlan,
    EntryKind,
    KeepReason,
    KeptEntry,
    PlannedDeletion,
    RootEntry,
    Usage,
    plan_collection,
    unmarked_root_refusal,
)
from ._render import human_bytes, plan_json, render_plan, render_report, report_json
from ._scan import plan_root, scan_root
from ._vanished import is_vanished
from ._version_files import (
    BadFileName,
    FileRemoval,
    PayloadRootFiles,
    VersionDir,
    VersionDirMissing,
    VersionDirRefused,
    plain_name_problem,
    remove_files,
)
from ._versions import min_fresh_version, parse_version, version_name
from ._wipe import WipeReport, init_root, wipe_root, wipe_root_async

__all__ = [
    "BadFileName",
    "BusyDir",
    "CollectionError",
    "CollectionPlan",
    "CollectionReport",
    "DeletedDir",
    "EntryKind",
    "FileRemoval",
    "KeepReason",
    "KeptEntry",
    "LockHeld",
    "PayloadGCError",
    "PayloadRootFiles",
    "PlannedDeletion",
    "RootEntry",
    "RootMissing",
    "RootRefused",
    "Usage",
    "VersionDir",
    "VersionDirMissing",
    "VersionDirRefused",
    "WipeReport",
    "collect_below",
    "collect_below_sync",
    "human_bytes",
    "init_root",
    "is_busy_name",
    "is_vanished",
    "min_fresh_version",
    "parse_version",
    "plain_name_problem",
    "plan_collection",
    "plan_json",
    "plan_root",
    "remove_files",
    "render_plan",
    "render_report",
    "report_json",
    "scan_root",
    "unmarked_root_refusal",
    "version_name",
    "wipe_root",
    "wipe_root_async",
]

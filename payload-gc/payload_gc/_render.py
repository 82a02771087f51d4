"""How the `payload-gc` command shows a plan (dry run) or a report (real run): a table
for people, or one JSON document."""

from __future__ import annotations

import json

import attrs

from ._busy import BUSY_LEFT
from ._collect import CollectionReport
from ._plan import CollectionPlan, EntryKind, KeptEntry, Usage
from ._versions import format_bound

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(size: int) -> str:
    """`size` in binary units for a table (`512 B`, `4.0 KiB`, `1.5 GiB`)."""
    value = float(size)
    for unit in _UNITS:
        if value < 1024 or unit == _UNITS[-1]:
            return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


@attrs.frozen
class _Row:
    name: str
    action: str
    version: int | None
    files: int | None
    bytes: int | None
    note: str = ""


def _kept_rows(kept: tuple[KeptEntry, ...]) -> list[_Row]:
    return [
        _Row(
            k.name,
            "keep",
            k.version,
            None if k.usage is None else k.usage.files,
            None if k.usage is None else k.usage.bytes,
            k.reason.value,
        )
        for k in kept
    ]


def _busy_note(usage: Usage | None) -> str:
    """What a dry run says of a directory holding busy files: a real run leaves them,
    and the directory, until they are closed."""
    if usage is None or not usage.busy:
        return ""
    files = "1 busy file" if usage.busy == 1 else f"{usage.busy} busy files"
    return f"holds {files} ({BUSY_LEFT}): stays, with the directory, until closed"


def _plan_rows(plan: CollectionPlan) -> list[_Row]:
    rows = [
        _Row(
            d.name,
            "delete",
            d.version,
            None if d.usage is None else d.usage.files,
            None if d.usage is None else d.usage.bytes,
            "symbolic link: unlinked, not followed"
            if d.kind is EntryKind.SYMLINK
            else _busy_note(d.usage),
        )
        for d in plan.delete
    ]
    return rows + _kept_rows(plan.keep)


def _report_rows(report: CollectionReport) -> list[_Row]:
    rows = [_Row(d.name, "deleted", d.version, d.files, d.bytes) for d in report.deleted]
    rows += [_Row(b.name, "busy", b.version, b.files, b.bytes, b.message) for b in report.busy]
    return rows + _kept_rows(report.kept)


def _table(rows: list[_Row]) -> list[str]:
    if not rows:
        return ["  (the root is empty)"]
    width = max(5, *(len(r.name) for r in rows))
    lines = [f"  {'entry':<{width}}  {'action':<7}  {'files':>9}  {'size':>10}  reason"]
    for r in rows:
        files = "-" if r.files is None else str(r.files)
        size = "-" if r.bytes is None else human_bytes(r.bytes)
        lines.append(f"  {r.name:<{width}}  {r.action:<7}  {files:>9}  {size:>10}  {r.note}")
    return [line.rstrip() for line in lines]


def _totals(dirs: int, files: int, size: int) -> str:
    return f"{dirs} directories, {files} files, {size} bytes"


def render_plan(root: str, plan: CollectionPlan) -> str:
    """The dry-run text: its first line says that nothing was deleted."""
    totals = _totals(len(plan.delete), plan.files, plan.bytes)
    lines = [
        "DRY RUN: nothing was deleted",
        f"would delete {totals} from {root} (bound {format_bound(plan.bound)})",
        "",
        *_table(_plan_rows(plan)),
        "",
    ]
    busy = [d for d in plan.delete if d.usage is not None and d.usage.busy]
    if busy:
        names = ", ".join(d.name for d in busy)
        lines.append(
            f"BUSY: {names} hold busy files ({BUSY_LEFT}); a real run would leave "
            "them in place (exit 0) and the next collection would try again"
        )
    lines.append(f"total that would be deleted: {totals}")
    return "\n".join(lines)


def render_report(report: CollectionReport) -> str:
    """The text after a real collection: its first line says what was deleted."""
    totals = _totals(report.dirs, report.files, report.bytes)
    lines = [
        f"deleted {totals} from {report.root} (bound {format_bound(report.bound)})",
        "",
        *_table(_report_rows(report)),
        "",
    ]
    if report.errors:
        lines.append(f"PARTIAL: {len(report.errors)} entries could not be deleted entirely:")
        lines.extend(f"  {e.name}: {e.message}" for e in report.errors)
    if report.busy:
        lines.append(f"BUSY: {len(report.busy)} directories left only for busy files:")
        lines.extend(f"  {b.name}: {b.message}" for b in report.busy)
    lines.append(f"total deleted: {totals} in {report.duration_s:.3f} s ({report.outcome})")
    return "\n".join(lines)


def _row_json(row: _Row, usage: Usage | None = None) -> dict[str, object]:
    data: dict[str, object] = {
        "name": row.name,
        "version": row.version,
        "files": row.files,
        "bytes": row.bytes,
    }
    if usage is not None and usage.busy:
        data["busy_files"] = usage.busy
    if row.note:
        data["reason" if row.action == "keep" else "note"] = row.note
    return data


def plan_json(root: str, plan: CollectionPlan) -> str:
    """The dry run as one JSON document."""
    rows = _plan_rows(plan)
    usages = {d.name: d.usage for d in plan.delete}
    document = {
        "root": root,
        "bound": plan.bound,
        "dry_run": True,
        "delete": [_row_json(r, usages[r.name]) for r in rows if r.action != "keep"],
        "keep": [_row_json(r) for r in rows if r.action == "keep"],
        "totals": {"dirs": len(plan.delete), "files": plan.files, "bytes": plan.bytes},
    }
    return json.dumps(document, indent=2)


def report_json(report: CollectionReport) -> str:
    """A real collection as one JSON document."""
    rows = _report_rows(report)
    document = {
        "root": report.root,
        "bound": report.bound,
        "dry_run": False,
        "delete": [_row_json(r) for r in rows if r.action == "deleted"],
        "keep": [_row_json(r) for r in rows if r.action == "keep"],
        "totals": {"dirs": report.dirs, "files": report.files, "bytes": report.bytes},
        "duration_s": report.duration_s,
        "outcome": report.outcome,
        "errors": [{"name": e.name, "message": e.message} for e in report.errors],
        "busy": [
            {
                "name": b.name,
                "version": b.version,
                "files": b.files,
                "bytes": b.bytes,
                "busy_files": b.busy,
                "paths": list(b.paths),
                "message": b.message,
            }
            for b in report.busy
        ],
    }
    return json.dumps(document, indent=2)

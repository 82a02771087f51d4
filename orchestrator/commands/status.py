"""`orchestrator status --config FILE [--set KEY=VALUE ...] [--json]`: a run, from disk.

Shows whether a daemon holds the run's lock, the last shipped step, the applied and
published versions, the last collection bound, the in-flight and queued counts of the
last saved progress, the figures of the daemon's last `progress` line (rollouts per
second, recent discards and failures), and the payload root's entries: files and bytes
of each `v<k>`, and whether the daemon's next collection removes it. Reads files only,
so it works the same whether the daemon runs or not.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from payload_gc import CollectionPlan, RootEntry

    from orchestrator.commands.inspect import DaemonLock, RunOnDisk
    from orchestrator.handoff import Progress

HELP = "show a run's step, versions, daemon and per-version payload disk use, from disk"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--config FILE`, any number of `--set KEY=VALUE`, and `--json`."""
    from orchestrator.config import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON document")


def run(args: argparse.Namespace) -> int:
    """Print the run's status (exit 0). A bad config or a run directory that does not
    exist raises a UserError (one line, exit 2); a missing payload root is reported in
    the output, not as an error."""
    import time

    from orchestrator.commands.inspect import read_run_on_disk
    from orchestrator.config import config_from_args

    config = config_from_args(args)
    snapshot = read_run_on_disk(config, source=str(args.config))
    payload = survey_payload_root(snapshot)
    now = time.time()
    if args.json:
        print(json.dumps(status_document(snapshot, payload, now), indent=2))
    else:
        print(render_status(snapshot, payload, now))
    return 0


@attrs.frozen
class PayloadRow:
    """One direct child of the payload root, as the status table shows it.

    `removed_next` says whether the next collection removes it (None: unknown, because
    no applied version is known); `reason` why it stays (None when removed or unknown).
    """

    name: str
    version: int | None
    files: int | None
    bytes: int | None
    removed_next: bool | None
    reason: str | None


@attrs.frozen
class PayloadSurvey:
    """The payload root measured, and what the next collection would remove from it.

    `problem` (a sentence naming the root) is set, and `rows` empty, when the root is
    missing or cannot be read; `marked` is None then. `next_bound` is None when no
    applied version is known.
    """

    root: str
    exists: bool
    problem: str | None
    marked: bool | None
    next_bound: int | None
    rows: tuple[PayloadRow, ...]

    @property
    def version_rows(self) -> tuple[PayloadRow, ...]:
        return tuple(r for r in self.rows if r.version is not None)

    @property
    def removed_next(self) -> tuple[PayloadRow, ...]:
        return tuple(r for r in self.rows if r.removed_next)


def totals(rows: Iterable[PayloadRow]) -> dict[str, int]:
    """Entries, files and bytes of `rows` (unmeasured entries count as nothing)."""
    listed = list(rows)
    return {
        "dirs": len(listed),
        "files": sum(r.files or 0 for r in listed),
        "bytes": sum(r.bytes or 0 for r in listed),
    }


def survey_payload_root(snapshot: RunOnDisk) -> PayloadSurvey:
    """Measure the payload root (one scan through payload_gc) and plan the next collection
    on it: the one after `v{applied + 1}` is applied. Deletes nothing. Blocking.

    Never raises for the root itself: a missing or unreadable root is the survey's
    `problem`.
    """
    from payload_gc import PayloadGCError, RootMissing, plan_collection, scan_root

    root = str(snapshot.payload_root)
    next_bound = None
    if snapshot.progress is not None:
        next_bound = snapshot.staleness.collection_bound(snapshot.progress.applied_version + 1)
    try:
        entries = scan_root(root)
    except RootMissing:
        return PayloadSurvey(
            root, False, f"payload root {root} does not exist yet", None, next_bound, ()
        )
    except PayloadGCError as exc:
        return PayloadSurvey(root, True, str(exc), None, next_bound, ())
    except OSError as exc:
        # E.g. the root became unreadable while listed: a status line, not a traceback.
        return PayloadSurvey(
            root,
            True,
            f"payload root {root} cannot be read: {exc.strerror or exc}",
            None,
            next_bound,
            (),
        )
    # The marker does not depend on the bound; any bound tells whether the root has it.
    plan = plan_collection(entries, next_bound if next_bound is not None else 0)
    rows = payload_rows(entries, plan if next_bound is not None else None)
    return PayloadSurvey(root, True, None, plan.marked, next_bound, rows)


def payload_rows(
    entries: Iterable[RootEntry], plan: CollectionPlan | None
) -> tuple[PayloadRow, ...]:
    """The status table's rows, versions first in numeric order, then the other names.

    With a `plan` each row says whether that collection removes the entry and why it
    stays otherwise; without one (no applied version known) that is left unknown.
    """
    rows: list[PayloadRow]
    if plan is None:
        rows = [
            PayloadRow(
                e.name,
                e.version,
                None if e.usage is None else e.usage.files,
                None if e.usage is None else e.usage.bytes,
                None,
                None,
            )
            for e in entries
        ]
    else:
        rows = [
            PayloadRow(
                d.name,
                d.version,
                None if d.usage is None else d.usage.files,
                None if d.usage is None else d.usage.bytes,
                True,
                None,
            )
            for d in plan.delete
        ]
        rows.extend(
            PayloadRow(
                k.name,
                k.version,
                None if k.usage is None else k.usage.files,
                None if k.usage is None else k.usage.bytes,
                False,
                k.reason.value,
            )
            for k in plan.keep
        )
    rows.sort(key=_row_order)
    return tuple(rows)


def _row_order(row: PayloadRow) -> tuple[int, int, str]:
    if row.version is None:
        return (1, 0, row.name)
    return (0, row.version, row.name)


# -- JSON ------------------------------------------------------------------------------


def status_document(snapshot: RunOnDisk, payload: PayloadSurvey, now: float) -> dict[str, Any]:
    """The status as one JSON-ready document (the same facts as the text)."""
    progress = snapshot.progress
    next_collection = None
    if payload.next_bound is not None:
        assert progress is not None  # a next bound is known only from progress
        next_collection = {
            "after_version": progress.applied_version + 1,
            "bound": payload.next_bound,
        }
    return {
        "run_dir": str(snapshot.run_dir),
        "daemon": {
            "running": snapshot.daemon.running,
            "holder": snapshot.daemon.holder,
            "lock_file": str(snapshot.daemon.path),
        },
        "last_shipped_step": snapshot.shipped_step,
        "latest_published_version": snapshot.published_version,
        "max_off_policy_steps": snapshot.max_off_policy_steps,
        "progress_file": str(snapshot.progress_path),
        "progress_problem": snapshot.progress_problem,
        "progress": None if progress is None else _progress_json(progress, now),
        "shipping": None if progress is None else _shipping_json(snapshot, progress, now),
        "next_collection": next_collection,
        "payload_root": _payload_json(payload),
    }


def _progress_json(progress: Progress, now: float) -> dict[str, Any]:
    return {
        "updated_at": progress.updated_at,
        "age_s": round(now - progress.updated_at, 3) if progress.updated_at > 0 else None,
        "pid": progress.pid,
        "step": progress.step,
        "applied_version": progress.applied_version,
        "last_collection_bound": progress.bound,
        # As of `updated_at`: the daemon saves progress after each batch and update.
        "inflight_rollouts": progress.inflight_rollouts,
        "inflight_limit": progress.inflight_limit or None,
        "queued_samples": progress.queued_samples,
        "discards": dict(progress.discards),
        "failures": dict(progress.failures),
        "started_at": progress.started_at or None,
        "last_shipped_at": progress.last_shipped_at,
        # Since the last shipped batch (or the daemon's start), as of `updated_at`.
        "recent_discards": dict(progress.recent_discards),
        "recent_failures": dict(progress.recent_failures),
        "top_error": None if progress.top_error is None else progress.top_error.to_json(),
        # What a batch takes (0: not recorded), and the daemon's last `progress` line:
        # its discards and failures count over its `interval_s` (None: no line yet).
        "needed_samples": progress.needed_samples,
        "last_report": None if progress.last_report is None else progress.last_report.to_json(),
        "last_report_at": progress.last_report_at,
    }


def _shipping_json(snapshot: RunOnDisk, progress: Progress, now: float) -> dict[str, Any]:
    quiet = quiet_seconds(progress, now)
    return {
        "quiet_s": None if quiet is None else round(quiet, 1),
        "stall_warning_s": snapshot.stall_warning_s,
        "stalled": is_stalled(snapshot, progress, now),
        "summary": describe_shipping(snapshot, progress, now),
    }


# -- shipping: is the run stalled? -----------------------------------------------------


def quiet_seconds(progress: Progress, now: float) -> float | None:
    """Seconds since the daemon last shipped a batch (or started, when it has shipped
    none); None when the progress file predates these times."""
    since = progress.last_shipped_at or progress.started_at
    return None if since <= 0 else now - since


def is_stalled(snapshot: RunOnDisk, progress: Progress, now: float) -> bool:
    """Whether a daemon that may be running has shipped nothing for `stall_warning_s`."""
    quiet = quiet_seconds(progress, now)
    return (
        snapshot.daemon.running is not False
        and snapshot.stall_warning_s > 0
        and quiet is not None
        and quiet >= snapshot.stall_warning_s
    )


def describe_shipping(snapshot: RunOnDisk, progress: Progress, now: float) -> str | None:
    """One line on shipping: `no batch shipped for 45 s; most discards: untrainable (4512);
    most common error: malformed: ... (903x)` when stalled, else when the last batch
    shipped. None for a progress file without these times."""
    from orchestrator.commands.inspect import format_as_of
    from orchestrator.daemon.reporting.stall import most_discarded

    quiet = quiet_seconds(progress, now)
    if quiet is None:
        return None
    if is_stalled(snapshot, progress, now):
        parts = [f"no batch shipped for {quiet:.0f} s"]
    elif progress.last_shipped_at is not None:
        parts = [f"last batch shipped {format_as_of(progress.last_shipped_at, now)}"]
    else:
        parts = [f"none since the daemon started {format_as_of(progress.started_at, now)}"]
    dominant = most_discarded(progress.recent_discards)
    if dominant is not None:
        parts.append(f"most discards: {dominant[0]} ({dominant[1]})")
    if progress.top_error is not None:
        parts.append(f"most common error: {progress.top_error.describe()}")
    return "; ".join(parts)


def _payload_json(payload: PayloadSurvey) -> dict[str, Any]:
    removed = payload.removed_next if payload.next_bound is not None else None
    return {
        "path": payload.root,
        "exists": payload.exists,
        "problem": payload.problem,
        "marked": payload.marked,
        "entries": [
            {
                "name": r.name,
                "version": r.version,
                "files": r.files,
                "bytes": r.bytes,
                "removed_by_next_collection": r.removed_next,
                "reason": r.reason,
            }
            for r in payload.rows
        ],
        "totals": totals(payload.version_rows),
        "next_collection_removes": None if removed is None else totals(removed),
    }


# -- text ------------------------------------------------------------------------------


def render_status(snapshot: RunOnDisk, payload: PayloadSurvey, now: float) -> str:
    """The status for people: the run's facts, then the payload root's table."""
    from orchestrator.commands.inspect import format_version

    progress = snapshot.progress
    facts: list[tuple[str, str]] = [
        ("daemon", _describe_daemon(snapshot.daemon, now)),
        ("last shipped", _describe_shipped(snapshot)),
        ("published", f"{format_version(snapshot.published_version)} (latest weights)"),
    ]
    if progress is None:
        facts.append(("progress", f"none: {snapshot.progress_path} is {snapshot.progress_problem}"))
    else:
        facts.extend(_progress_facts(progress, now))
        shipping = describe_shipping(snapshot, progress, now)
        if shipping is not None:
            facts.append(("shipping", shipping))
    facts.append(("next collection", _describe_next(snapshot, payload)))
    width = max(len(label) for label, _ in facts) + 1
    lines = [f"run {snapshot.run_dir}"]
    lines.extend(f"  {label + ':':<{width}} {text}" for label, text in facts)
    lines.append("")
    lines.extend(_payload_lines(payload))
    return "\n".join(lines)


def _describe_daemon(daemon: DaemonLock, now: float) -> str:
    from orchestrator.commands.inspect import describe_holder

    if daemon.running is None:
        return f"unknown: cannot check the lock {daemon.path}"
    holder = None if daemon.holder is None else describe_holder(daemon.holder, now)
    if daemon.running:
        return f"running ({holder or 'holder not recorded'})"
    if holder is None:
        return "not running"
    return f"not running (last: {holder})"


def _describe_shipped(snapshot: RunOnDisk) -> str:
    text = f"step {snapshot.shipped_step}" if snapshot.shipped_step else "none"
    progress = snapshot.progress
    if progress is not None and progress.step != snapshot.shipped_step:
        # The batch directories are the truth; progress lags after a crash mid-save.
        text += f" (progress.json says {progress.step})"
    return text


def _progress_facts(progress: Progress, now: float) -> list[tuple[str, str]]:
    from orchestrator.commands.inspect import format_as_of, format_version

    as_of = format_as_of(progress.updated_at, now)
    # The daemon saves every reason, most of them 0 for most of a run: show the others.
    discards = _counts_text(progress.discards)
    queued = f"{progress.queued_samples} queued samples"
    if progress.needed_samples:
        queued = f"{progress.queued_samples} of {progress.needed_samples} queued samples"
    return [
        ("applied", format_version(progress.applied_version)),
        (
            "last collection",
            "none yet" if progress.bound is None else f"bound {format_version(progress.bound)}",
        ),
        (
            "in flight",
            f"{progress.inflight_rollouts} rollouts{_limit_text(progress.inflight_limit)}, "
            f"{queued} (as of {as_of})",
        ),
        ("discards", discards or "none"),
        *_failure_facts(progress),
        *_report_facts(progress, now),
    ]


def _limit_text(limit: int) -> str:
    """` (limit 96)`, or nothing when the limit was not recorded."""
    return f" (limit {limit})" if limit else ""


def _counts_text(counts: Mapping[str, int]) -> str:
    """`stale 2, untrainable 7`: the non-zero counts, by name."""
    return ", ".join(f"{name} {n}" for name, n in sorted(counts.items()) if n)


def _rewards_text(scored: Mapping[str, int], mean_reward: Mapping[str, float]) -> list[str]:
    """`mean reward arith 0.06 over 40, chat 0.16 over 12`, or nothing when none scored."""
    parts = [
        f"{env or '(unnamed)'} {mean_reward.get(env, 0.0):.3g} over {n}"
        for env, n in sorted(scored.items())
    ]
    return [f"mean reward {', '.join(parts)}"] if parts else []


def _report_facts(progress: Progress, now: float) -> list[tuple[str, str]]:
    """The daemon's last `progress` line: `step 3, 5 of 16 samples ready, 8 rollouts in
    flight, 12.4 rollouts/s; discards untrainable 372; no failures (over the 30 s to
    <time>, 4 s ago)`. Nothing before the first line (or from older progress files)."""
    from orchestrator.commands.inspect import format_as_of

    line = progress.last_report
    if line is None:
        return []
    parts = [
        f"step {line.step}, {line.queued_samples} of {line.needed_samples} samples ready, "
        f"{line.inflight_rollouts} rollouts in flight{_limit_text(line.inflight_limit)}, "
        f"{line.rollouts_per_s:g} rollouts/s"
        + (
            ""
            if line.cpu_s_per_rollout is None
            else f" ({line.cpu_s_per_rollout * 1000:.2f} ms daemon CPU each)"
        ),
        f"discards {_counts_text(line.discards)}" if any(line.discards.values()) else "no discards",
        f"failures {_counts_text(line.failures)}" if any(line.failures.values()) else "no failures",
        *_rewards_text(line.scored, line.mean_reward),
    ]
    when = format_as_of(progress.last_report_at or 0.0, now)
    return [("progress line", f"{'; '.join(parts)} (over the {line.interval_s:g} s to {when})")]


def _failure_facts(progress: Progress) -> list[tuple[str, str]]:
    # Shown only when the daemon saved them (older progress files have none).
    failures = _counts_text(progress.failures)
    return [("failures", failures)] if failures else []


def _describe_next(snapshot: RunOnDisk, payload: PayloadSurvey) -> str:
    from orchestrator.commands.inspect import format_version

    if payload.next_bound is None or snapshot.progress is None:
        return "unknown (no applied version saved)"
    after = format_version(snapshot.progress.applied_version + 1)
    return (
        f"after {after} is applied: bound {format_version(payload.next_bound)}"
        f" (max_off_policy_steps {snapshot.max_off_policy_steps})"
    )


def _payload_lines(payload: PayloadSurvey) -> list[str]:
    from orchestrator.commands.inspect import format_table, human_bytes

    if payload.problem is not None:
        return [payload.problem]
    title = f"payload root {payload.root}"
    if payload.marked is False:
        title += " (no .payload-root marker)"
    if not payload.rows:
        return [title, "  (empty)"]
    table = format_table(
        ("entry", "files", "size", "next collection"),
        (
            (
                r.name,
                "-" if r.files is None else str(r.files),
                "-" if r.bytes is None else human_bytes(r.bytes),
                _next_cell(r),
            )
            for r in payload.rows
        ),
        numeric={1, 2},
    )
    total = totals(payload.version_rows)
    summary = (
        f"total: {total['dirs']} version directories, {total['files']} files, "
        f"{human_bytes(total['bytes'])}"
    )
    if payload.next_bound is not None:
        removed = totals(payload.removed_next)
        summary += (
            f"; the next collection removes {removed['dirs']} directories, "
            f"{removed['files']} files, {human_bytes(removed['bytes'])}"
        )
    return [title, *table, "", summary]


def _next_cell(row: PayloadRow) -> str:
    if row.removed_next is None:
        return "?"
    if row.removed_next:
        return "remove"
    return f"keep ({row.reason})" if row.reason else "keep"

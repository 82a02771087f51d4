"""`orchestrator gc --config FILE [--set KEY=VALUE ...] [--dry-run [--measure-kept]] [--json]`:
one collection.

The bound comes from the run's own state: `min_fresh_version(applied + 1, m)`, with
`applied` the applied version the daemon last saved in `progress.json`, never more: a
version the daemon has not applied may still be in use by inference servers, and a batch
the trainer has not read may still reference files below a higher bound (docs/design.md §3).

The collection goes through `payload_gc.collect_below_sync`, so it takes the collector's
lock: it is safe while the daemon runs (the daemon's own collections wait for the lock),
and another collection running is a one-line refusal. It lists the root and enters only
the directories it deletes; the dry run measures those, and the kept versions only with
`--measure-kept` (`orchestrator status` measures everything). Exit status: 0 done (also
when the only things left are busy files: deleted while still open elsewhere, retried by
the next collection), 1 partial (something else could not be deleted), 2 refused.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:
    from payload_gc import CollectionPlan, CollectionReport

    from orchestrator.commands.inspect import RunOnDisk

HELP = "run one payload collection from the run's saved state (--dry-run: only show it)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--config FILE`, any number of `--set KEY=VALUE`, `--dry-run` and `--json`."""
    from orchestrator.config import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument(
        "--dry-run", action="store_true", help="show what would be deleted; delete nothing"
    )
    parser.add_argument(
        "--measure-kept",
        action="store_true",
        help="with --dry-run: measure the kept versions too (walks every file in the root)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")


@attrs.frozen
class RunBound:
    """The bound of this collection and where it comes from."""

    bound: int
    applied_version: int
    max_off_policy_steps: int
    progress_updated_at: float


def run(args: argparse.Namespace) -> int:
    """Collect (or with `--dry-run` plan) the run's payload root at the bound its saved
    state allows; print the result. Returns 1 when the collection was partial (busy
    files alone are not: they go once closed, and the next collection retries).

    Raises UserError (one line, exit 2) for a bad config, a missing run directory, no
    readable progress, a missing or unsafe payload root, or a lock held by another
    collector.
    """
    import time

    from payload_gc import PayloadGCError, collect_below_sync, plan_root

    from orchestrator.commands.inspect import list_payload_root, read_run_on_disk
    from orchestrator.config import config_from_args
    from orchestrator.errors import UserError

    config = config_from_args(args)
    if args.measure_kept and not args.dry_run:
        raise UserError("--measure-kept goes with --dry-run (a real run measures nothing kept)")
    run_bound = bound_from_state(read_run_on_disk(config, source=str(args.config)))
    root = str(config.payload_root)
    now = time.time()
    try:
        if args.dry_run:
            plan = plan_root(root, run_bound.bound, measure_kept=args.measure_kept)
            check_payload_root(root, plan)
            print(
                dry_run_json(root, plan, run_bound)
                if args.json
                else render_dry_run(root, plan, run_bound, now)
            )
            return 0
        # Only the root's direct children: the collection enters only what it deletes.
        check_payload_root(root, list_payload_root(config.payload_root, run_bound.bound))
        report = collect_below_sync(root, run_bound.bound)
    except PayloadGCError as exc:
        # Missing or unsafe root, or another collector holds the lock: all one line.
        raise UserError(str(exc)) from None
    except OSError as exc:
        # Whatever payload_gc did not anticipate still gets one line, not a traceback.
        raise UserError(f"payload root {root}: {exc.strerror or exc}") from None
    print(report_json(report, run_bound) if args.json else render_report(report, run_bound, now))
    return 1 if report.errors else 0


def bound_from_state(snapshot: RunOnDisk) -> RunBound:
    """The collection bound the run's saved progress allows.

    Raises UserError when there is no readable progress: then no applied version is
    known, so no payload version is known to be safe to delete.
    """
    from orchestrator.errors import UserError

    progress = snapshot.progress
    if progress is None:
        raise UserError(
            f"no applied version is known ({snapshot.progress_path} is "
            f"{snapshot.progress_problem}), so nothing is known to be safe to delete; "
            "start the daemon (it saves progress), or use payload-gc --below K"
        )
    return RunBound(
        bound=snapshot.staleness.collection_bound(progress.applied_version),
        applied_version=progress.applied_version,
        max_off_policy_steps=snapshot.max_off_policy_steps,
        progress_updated_at=progress.updated_at,
    )


def check_payload_root(root: str, plan: CollectionPlan) -> None:
    """Refuse a root that may not be a payload root at all (a mistyped `payload.root`,
    say), by payload_gc's rule: `payload_gc.unmarked_root_refusal`.

    Raises UserError naming an example entry.
    """
    from payload_gc import unmarked_root_refusal

    from orchestrator.errors import UserError

    refusal = unmarked_root_refusal(root, plan)
    if refusal is not None:
        raise UserError(refusal)


# -- output: payload-gc's own, with the line that says where the bound comes from ----


def _why(run_bound: RunBound, now: float) -> str:
    from orchestrator.commands.inspect import format_as_of, format_version

    return (
        f"bound {format_version(run_bound.bound)} = min_fresh_version(applied "
        f"{format_version(run_bound.applied_version)} + 1, max_off_policy_steps "
        f"{run_bound.max_off_policy_steps}); applied version saved at "
        f"{format_as_of(run_bound.progress_updated_at, now)}"
    )


def render_dry_run(root: str, plan: CollectionPlan, run_bound: RunBound, now: float) -> str:
    """The dry run for people; its first line says that nothing was deleted."""
    from payload_gc import render_plan

    lines = render_plan(root, plan).split("\n")
    # After "DRY RUN: ..." and "would delete ... (bound vK)".
    lines.insert(2, _why(run_bound, now))
    return "\n".join(lines)


def render_report(report: CollectionReport, run_bound: RunBound, now: float) -> str:
    """A real collection for people; its first line says what was deleted."""
    from payload_gc import render_report as render_gc_report

    lines = render_gc_report(report).split("\n")
    lines.insert(1, _why(run_bound, now))
    return "\n".join(lines)


def _with_run(document_json: str, run_bound: RunBound) -> str:
    document = json.loads(document_json)
    document["run"] = {
        "applied_version": run_bound.applied_version,
        "max_off_policy_steps": run_bound.max_off_policy_steps,
        "progress_updated_at": run_bound.progress_updated_at,
    }
    return json.dumps(document, indent=2)


def dry_run_json(root: str, plan: CollectionPlan, run_bound: RunBound) -> str:
    """The dry run as one JSON document (`delete` lists exactly what a real run deletes)."""
    from payload_gc import plan_json

    return _with_run(plan_json(root, plan), run_bound)


def report_json(report: CollectionReport, run_bound: RunBound) -> str:
    """A real collection as one JSON document."""
    from payload_gc import report_json as gc_report_json

    return _with_run(gc_report_json(report), run_bound)

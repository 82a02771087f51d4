"""The `payload-gc` command: one collection of a payload root, or a dry run of it.

    payload-gc --root DIR (--below K | --step S --max-off-policy-steps M)
               [--dry-run [--measure-kept]] [--json] [--init] [--workers N]

A real run lists the root and enters only the directories it deletes; a dry run measures
those (files, bytes, busy files), and the kept versions too only with --measure-kept.

Exit status: 0 done, including when the only things left below the bound are busy files
(deleted while still open elsewhere: `.nfs*`, `.fuse_hidden*`), which the next run
retries; 1 if the collection was partial (something else could not be deleted, or a
mount point below the bound was left); 2 for bad arguments or a root it refuses
(missing, a link, locked by another collector, or not marked as a payload root while
holding other things); those print one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from ._collect import collect_below_sync
from ._errors import PayloadGCError
from ._layout import MARKER_NAME
from ._plan import unmarked_root_refusal
from ._render import plan_json, render_plan, render_report, report_json
from ._scan import plan_root
from ._versions import min_fresh_version
from ._wipe import init_root

PROG = "payload-gc"


class UsageError(Exception):
    """Arguments that parse but do not make sense together."""


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog=PROG,
        description="Delete the payload directories <root>/v<k> below a staleness bound.",
        epilog=(
            "The bound is K (--below) or min_fresh_version(S + 1, M) = S - M once policy "
            "version S is applied everywhere (--step S --max-off-policy-steps M). "
            "Exit status: 0 done (also when only busy files, deleted while still open "
            "elsewhere, were left: the next run retries them), 1 partial (something else "
            "could not be deleted), 2 refused (one line on stderr)."
        ),
    )
    parser.add_argument("--root", required=True, type=Path, help="the payload root")
    parser.add_argument("--below", type=int, metavar="K", help="delete every v<k> with k < K")
    parser.add_argument(
        "--step", type=int, metavar="S", help="the policy version every server has applied"
    )
    parser.add_argument(
        "--max-off-policy-steps", type=int, metavar="M", help="the run's max_off_policy_steps"
    )
    parser.add_argument("--dry-run", action="store_true", help="show what would go; delete nothing")
    parser.add_argument(
        "--measure-kept",
        action="store_true",
        help="with --dry-run: measure the kept versions too (walks every file in the root)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument(
        "--init",
        action="store_true",
        help=f"mark the root as a payload root ({MARKER_NAME}), then collect if a bound is given",
    )
    parser.add_argument(
        "--workers", type=int, default=4, metavar="N", help="deletion threads (default 4)"
    )
    return parser


def bound_from_args(args: argparse.Namespace) -> int | None:
    """The collection bound the arguments ask for (`None`: none given, `--init` alone).

    Raises `UsageError` for a combination that does not make sense.
    """
    if args.below is not None and (args.step is not None or args.max_off_policy_steps is not None):
        raise UsageError("--below cannot be combined with --step/--max-off-policy-steps")
    if args.workers < 1:
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    if args.measure_kept and not args.dry_run:
        raise UsageError("--measure-kept goes with --dry-run (a real run measures nothing kept)")
    if args.below is not None:
        return int(args.below)
    if args.step is None and args.max_off_policy_steps is None:
        if args.init:
            return None
        raise UsageError("give the bound: --below K, or --step S --max-off-policy-steps M")
    if args.step is None or args.max_off_policy_steps is None:
        raise UsageError("--step and --max-off-policy-steps go together")
    if args.max_off_policy_steps < 0:
        raise UsageError(f"--max-off-policy-steps must be >= 0, got {args.max_off_policy_steps}")
    # After v{S} is applied everywhere, batches <= S were read (docs/design.md §3).
    return min_fresh_version(int(args.step) + 1, int(args.max_off_policy_steps))


def _run(args: argparse.Namespace) -> int:
    bound = bound_from_args(args)
    root = os.fspath(Path(args.root).absolute())
    if args.init:
        init_root(root)
        if bound is None:
            if args.json:
                print(json.dumps({"root": root, "marked": True}))
            else:
                print(f"marked {root} as a payload root ({MARKER_NAME})")
            return 0
    assert bound is not None  # bound_from_args returns None only with --init
    # A dry run measures what it would delete (kept versions on request); a real run
    # only lists the root here, for the marker check, and measures as it deletes.
    plan = plan_root(root, bound, measure=args.dry_run, measure_kept=args.measure_kept)
    refusal = unmarked_root_refusal(root, plan)
    if refusal is not None:
        raise UsageError(refusal)
    if args.dry_run:
        print(plan_json(root, plan) if args.json else render_plan(root, plan))
        return 0
    report = collect_below_sync(root, bound, max_workers=args.workers)
    print(report_json(report) if args.json else render_report(report))
    # Busy files alone do not fail the run: they go once closed, and the next run retries.
    return 1 if report.errors else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command with `argv` (default: `sys.argv[1:]`); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (UsageError, PayloadGCError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
    except OSError as exc:
        # Anything the library did not anticipate still gets one line, not a traceback.
        print(f"{PROG}: error: {exc.strerror or exc}: {exc.filename or args.root}", file=sys.stderr)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    return 2

"""`orchestrator report --config FILE [--set KEY=VALUE ...] [--out PATH] [--format html|png]`:
a run's training curves, from what it wrote (docs/design.md § Reports).

Reads `<run_dir>/steps.jsonl`, `<run_dir>/evals.jsonl` and the daemon's `progress.json`,
whether the daemon runs or not, and writes `<run_dir>/report.html` (or the `--out` path):
one page that opens in any browser, offline.
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "draw a run's training curves (reward, evals, discards, staleness, disk) as HTML or PNG"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from orchestrator.config import add_config_arguments

    add_config_arguments(parser)
    parser.add_argument(
        "--out", type=Path, help="where to write it (default: <run_dir>/report.html or .png)"
    )
    parser.add_argument(
        "--format",
        choices=("html", "png"),
        help="html: a self-contained page (default); png: every plot on one image "
        "(default from --out's suffix)",
    )


def run(args: argparse.Namespace) -> int:
    """Write the report (exit 0) and say where. A bad config, a run directory that does
    not exist or a path that cannot be written is one line (exit 2)."""
    from orchestrator.config import config_from_args
    from orchestrator.errors import UserError
    from orchestrator.report import ReportFormat, read_records, write_report

    config = config_from_args(args)
    png = args.format == "png" or (
        args.format is None and args.out is not None and args.out.suffix == ".png"
    )
    fmt: ReportFormat = "png" if png else "html"
    out = args.out if args.out is not None else config.run_dir / f"report.{fmt}"
    records = read_records(
        config.run_dir,
        steps_file=config.steps_file,
        evals_file=config.evals_file,
        state_dir=config.state_dir,
        trainer_file=config.trainer_steps_file,
    )
    try:
        write_report(records, out.absolute(), fmt=fmt, title=f"Run {config.run_dir.name}")
    except OSError as exc:
        raise UserError(f"cannot write the report to {out}: {exc.strerror or exc}") from None
    steps = len(records.step_rows)
    print(f"report: {out} ({steps} steps, {len(records.evals)} evals)")
    return 0

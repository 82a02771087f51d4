"""Training curves a person can see: `orchestrator report` (docs/design.md § Reports).

It reads only what a run already writes (`steps.jsonl`, one line per shipped batch;
`evals.jsonl`, one line per eval; `progress.json`; the trainer's `trainer.jsonl`, one line
per trained step, when it writes one) and draws a self-contained HTML page (inline SVG, no
script, no network) or one PNG: reward per step and env, the trainer's loss and grad norm,
mismatch KL and clipped share (only with a `trainer.jsonl`), evals per version, discards
by reason, staleness of shipped samples, payload disk use and collections, rollouts per
second. `records.py` reads the files (a torn or foreign line is counted and passed over),
`figures.py` draws with matplotlib, `page.py` writes the page.
"""

from orchestrator.report.figures import PLOTS as PLOTS
from orchestrator.report.page import ReportFormat as ReportFormat
from orchestrator.report.page import write_report as write_report
from orchestrator.report.records import RunRecords as RunRecords
from orchestrator.report.records import read_records as read_records

__all__ = ["PLOTS", "ReportFormat", "RunRecords", "read_records", "write_report"]

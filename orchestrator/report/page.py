"""The report as one self-contained HTML page (inline SVG and CSS, no script, nothing
fetched) or one PNG, written atomically next to the run."""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from orchestrator.handoff import replace_file_atomically
from orchestrator.report.figures import plot_svg, plots_for, plots_png
from orchestrator.report.records import Record, RunRecords

ReportFormat = Literal["html", "png"]

_CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 1400px;
       padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; }
.facts { color: #555; margin-top: 0; }
.plots { display: grid; grid-template-columns: repeat(auto-fit, minmax(560px, 1fr));
         gap: 1em; }
figure { margin: 0; border: 1px solid #ddd; border-radius: 6px; padding: 0.5em; }
figure svg { width: 100%; height: auto; }
figure.empty { opacity: 0.6; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border-bottom: 1px solid #e4e4e4; padding: 0.25em 0.8em; text-align: right; }
th:first-child, td:first-child, .env { text-align: left; }
.note { color: #777; font-size: 0.9em; }
"""


def render_html(records: RunRecords, *, title: str) -> str:
    """The page: the run's facts, every plot (`plots_for`), the eval table."""
    figures = []
    for plot in plots_for(records):
        svg, drew = plot_svg(plot, records)
        css = "" if drew else ' class="empty"'
        note = (
            f'<figcaption class="note">{html.escape(plot.note)}</figcaption>' if plot.note else ""
        )
        figures.append(
            f'<figure id="{plot.name}" data-plot="{plot.name}"{css}>{svg}{note}</figure>'
        )
    sources = "steps.jsonl, evals.jsonl" + (", trainer.jsonl" if records.trainer else "")
    skipped = (
        f'<p class="note">{records.skipped_lines} line(s) of the run\'s records could not be '
        "read and were passed over (a torn last line after a crash, or a hand edit).</p>"
        if records.skipped_lines
        else ""
    )
    return (
        "<!DOCTYPE html>\n"
        f'<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<style>{_CSS}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        f'<p class="facts">{_facts(records)}</p>'
        f'<div class="plots">{"".join(figures)}</div>'
        f"<h2>Evals</h2>{_eval_table(records.evals)}{skipped}"
        f'<p class="note">Written by <code>orchestrator report</code> on '
        f"{html.escape(time.strftime('%Y-%m-%d %H:%M:%S %Z'))} from {sources} "
        "and progress.json.</p></body></html>\n"
    )


def _facts(records: RunRecords) -> str:
    rows = records.step_rows
    parts = [f"run directory <code>{html.escape(str(records.run_dir))}</code>"]
    if rows:
        elapsed = rows[-1]["time"] - rows[0]["time"]
        parts.append(f"{len(rows)} batches shipped (steps {rows[0]['step']}..{rows[-1]['step']})")
        if elapsed > 0:
            parts.append(f"{elapsed:.0f} s from the first batch to the last")
    else:
        parts.append("no batch shipped yet")
    parts.append(f"{len(records.evals)} evals")
    progress = records.progress
    if progress is not None and isinstance(progress.get("applied_version"), int):
        parts.append(f"applied version v{progress['applied_version']}")
    if progress is not None and isinstance(progress.get("updated_at"), int | float):
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(progress["updated_at"]))
        parts.append(f"progress saved {html.escape(stamp)}")
    return " · ".join(parts)


def _eval_table(evals: Sequence[Record]) -> str:
    if not evals:
        return '<p class="note">No evals: the run lists no [[eval.env]], or none ended yet.</p>'
    ks = sorted(
        {k for line in evals for r in line["envs"].values() for k in (r.get("pass_at") or {})},
        key=int,
    )
    head = "".join(f"<th>pass@{html.escape(k)}</th>" for k in ks)
    body = []
    for line in evals:
        for env, result in sorted(line["envs"].items()):
            passes = result.get("pass_at") or {}
            cells = "".join(f"<td>{_number(passes.get(k))}</td>" for k in ks)
            versions = ", ".join(f"v{v}" for v in result.get("versions", []))
            resumed = " (resumed)" if line.get("resumed") else ""
            body.append(
                f"<tr><td>v{line['version']}{resumed}</td><td class=env>{html.escape(env)}</td>"
                f"<td>{_number(result.get('reward_mean'))}</td>{cells}"
                f"<td>{result.get('samples', '')}</td><td>{result.get('failed', '')}</td>"
                f"<td>{_number(result.get('completion_tokens_mean'), 1)}</td>"
                f"<td>{html.escape(versions)}</td></tr>"
            )
    return (
        "<table><thead><tr><th>version</th><th class=env>env</th><th>mean reward</th>"
        f"{head}<th>samples</th><th>failed</th><th>tokens</th><th>sampled under</th></tr>"
        f"</thead><tbody>{''.join(body)}</tbody></table>"
    )


def _number(value: object, digits: int = 3) -> str:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return f"{value:.{digits}f}"
    return "-"


def write_report(records: RunRecords, out: Path, *, fmt: ReportFormat, title: str) -> Path:
    """Draw the report and put it at `out` atomically (a reader never sees half a page).
    Blocking. Raises OSError."""
    data = plots_png(records) if fmt == "png" else render_html(records, title=title).encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    # A page redrawn at will: no fsync (a crash loses at most this drawing).
    replace_file_atomically(out, data, fsync=False)
    return out

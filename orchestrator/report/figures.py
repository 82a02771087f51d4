"""The report's plots, drawn with matplotlib onto axes (no pyplot: no global state, no
display), as SVG for the page or all on one PNG.

The step lines carry the run's running totals (rollouts, discards, deletions) as the
daemon counted them; a resumed run's daemon counts from zero again, so a total that goes
down starts a new count, and the rate across that gap is left out.

The trainer's plots (loss and grad norm, mismatch KL, clipped share) come from its
`trainer.jsonl` and are on the report only when it wrote one (`plots_for`).
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import matplotlib
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from matplotlib.typing import RcKeyType

from orchestrator.report.records import Record, RunRecords

MIB = 1 << 20
_METADATA = re.compile(r"\s*<metadata>.*?</metadata>", re.DOTALL)


@attrs.frozen
class Plot:
    """One plot of the report: its id (the page's anchor), title, and how it is drawn;
    `draw` returns False when the run has nothing for it yet. `note`: a sentence the page
    puts under it. `when_none`: what the plot says when the run has shipped steps but
    nothing for this plot (`{steps}`: how many), instead of "nothing recorded yet"."""

    name: str
    title: str
    draw: Callable[[Axes, RunRecords], bool]
    note: str = ""
    when_none: str = ""

    def empty_text(self, records: RunRecords) -> str:
        """What the plot says when `draw` found nothing to draw."""
        steps = len(records.step_rows)
        if steps and self.when_none:
            return self.when_none.format(steps=steps)
        return "nothing recorded yet"


def _counts(row: Record, key: str) -> Mapping[str, float]:
    value = row.get(key) or {}
    return value if isinstance(value, dict) else {}


def _deltas(values: Sequence[float]) -> list[float | None]:
    """Per-step increments of a running total; None where it restarted (a resumed run's
    daemon counts from zero): the first value after it is its own increment."""
    out: list[float | None] = []
    previous: float | None = None
    for value in values:
        if previous is None or value < previous:
            out.append(None if previous is not None else value)
        else:
            out.append(value - previous)
        previous = value
    return out


def draw_reward(ax: Axes, records: RunRecords) -> bool:
    rows = [row for row in records.step_rows if row.get("reward_mean") is not None]
    if not rows:
        return False
    steps = [row["step"] for row in rows]
    ax.plot(steps, [row["reward_mean"] for row in rows], color="black", lw=2, label="all")
    for env in records.train_envs:
        points = [
            (row["step"], row["reward_by_env"][env])
            for row in rows
            if row["reward_by_env"].get(env) is not None
        ]
        if points:
            ax.plot(*zip(*points, strict=True), lw=1.2, label=env)
    ax.set(xlabel="step", ylabel="mean reward of the batch's samples")
    return True


def draw_evals(ax: Axes, records: RunRecords) -> bool:
    if not records.evals:
        return False
    for index, env in enumerate(records.eval_envs):
        color = f"C{index}"
        lines = [line for line in records.evals if env in line["envs"]]
        means = [
            (line["version"], line["envs"][env]["reward_mean"])
            for line in lines
            if line["envs"][env].get("reward_mean") is not None
        ]
        if means:
            ax.plot(*zip(*means, strict=True), "o-", color=color, label=f"{env} mean reward")
        top = _top_pass_at(lines, env)
        if top is not None:
            k, points = top
            ax.plot(*zip(*points, strict=True), "s--", color=color, label=f"{env} pass@{k}")
    ax.set(xlabel="policy version", ylabel="eval reward")
    return True


def _top_pass_at(lines: Sequence[Record], env: str) -> tuple[str, list[tuple[int, float]]] | None:
    """The largest k reported for `env`, with its value per version."""
    ks = {k for line in lines for k in (line["envs"][env].get("pass_at") or {})}
    if not ks:
        return None
    k = max(ks, key=int)
    points = [
        (line["version"], line["envs"][env]["pass_at"][k])
        for line in lines
        if (line["envs"][env].get("pass_at") or {}).get(k) is not None
    ]
    return (k, points) if points else None


def draw_discards(ax: Axes, records: RunRecords) -> bool:
    rows = records.step_rows
    reasons = sorted({r for row in rows for r, n in _counts(row, "discards").items() if n})
    if not rows or not reasons:
        return False
    steps = [row["step"] for row in rows]
    bottom = [0.0] * len(rows)
    for reason in reasons:
        per_step = [
            d or 0.0 for d in _deltas([_counts(row, "discards").get(reason, 0) for row in rows])
        ]
        ax.bar(steps, per_step, bottom=bottom, label=reason)
        bottom = [b + d for b, d in zip(bottom, per_step, strict=True)]
    ax.set(xlabel="step", ylabel="units discarded since the previous batch")
    return True


def draw_staleness(ax: Axes, records: RunRecords) -> bool:
    rows = [row for row in records.step_rows if row.get("staleness_mean") is not None]
    if not rows:
        return False
    steps = [row["step"] for row in rows]
    ax.plot(steps, [row["staleness_mean"] for row in rows], label="mean")
    ax.plot(steps, [row["staleness_max"] for row in rows], "--", label="max")
    ax.set(xlabel="step", ylabel="batch - 1 - start version")
    return True


def draw_payload(ax: Axes, records: RunRecords) -> bool:
    rows = records.step_rows
    if not rows:
        return False
    steps = [row["step"] for row in rows]
    collected = _deltas([_counts(row, "bytes_deleted").get("collection", 0) for row in rows])
    ax.bar(steps, [(c or 0) / MIB for c in collected], color="C1", alpha=0.6, label="collected")
    ax.plot(steps, [row.get("payload_bytes", 0) / MIB for row in rows], color="C0", label="on disk")
    ax.set(xlabel="step", ylabel="MiB")
    return True


def draw_throughput(ax: Axes, records: RunRecords) -> bool:
    rows = records.step_rows
    finished = [sum(_counts(row, "rollouts").values()) for row in rows]
    deltas = _deltas(finished)
    points = []
    for index in range(1, len(rows)):
        elapsed, done = rows[index]["time"] - rows[index - 1]["time"], deltas[index]
        if done is not None and elapsed > 0:
            points.append((rows[index]["step"], done / elapsed))
    if not points:
        return False
    ax.plot(*zip(*points, strict=True), "o-", markersize=3)
    ax.set(xlabel="step", ylabel="rollouts finished per second")
    return True


def draw_trainer_loss(ax: Axes, records: RunRecords) -> bool:
    """The loss on the left axis, the grad norm on a right one, one legend for both."""
    rows = records.trainer_rows
    if not rows:
        return False
    steps = [row["step"] for row in rows]
    (loss,) = ax.plot(steps, [row["loss"] for row in rows], color="C0", lw=1.5)
    ax.set(xlabel="step", ylabel="loss")
    twin = ax.twinx()
    (grad,) = twin.plot(steps, [row["grad_norm"] for row in rows], "--", color="C1", lw=1.2)
    twin.set_ylabel("grad norm")
    twin.grid(False)  # the loss axis's grid is the plot's
    twin.legend([loss, grad], ["loss", "grad norm"], loc="best", fontsize=8)
    return True


_MISMATCH_SERIES = (
    ("mismatch_kl", "with router replay", "o-", "C0"),
    ("mismatch_kl_no_replay", "without router replay", "s--", "C3"),
)


def draw_mismatch(ax: Axes, records: RunRecords) -> bool:
    """Each KL series on a log axis: a null step (no on-policy samples, not measured) is
    left out of its line, as is a value a log axis cannot show (<= 0); a series with no
    value left is not drawn."""
    drew = False
    for key, label, style, color in _MISMATCH_SERIES:
        points = [
            (row["step"], row[key])
            for row in records.trainer_rows
            if row.get(key) is not None and row[key] > 0
        ]
        if points:
            ax.plot(*zip(*points, strict=True), style, color=color, markersize=3, label=label)
            drew = True
    if not drew:
        return False
    ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="KL(inference || trainer)")
    return True


def draw_clipped(ax: Axes, records: RunRecords) -> bool:
    rows = records.trainer_rows
    if not rows:
        return False
    ax.plot([row["step"] for row in rows], [row["clipped_share"] for row in rows], color="C2")
    ax.set_ylim(bottom=0)
    ax.set(xlabel="step", ylabel="share of loss tokens clipped")
    return True


PLOTS: tuple[Plot, ...] = (
    Plot("reward", "Reward per step, by env", draw_reward),
    Plot("evals", "Evals per policy version", draw_evals),
    Plot("discards", "Discards by reason", draw_discards, when_none="no discards in {steps} steps"),
    Plot("staleness", "Staleness of shipped samples", draw_staleness),
    Plot("payload", "Payload disk use and collections", draw_payload),
    Plot("throughput", "Rollouts per second", draw_throughput),
)

TRAINER_PLOTS: tuple[Plot, ...] = (
    Plot("loss", "Trainer loss and grad norm per step", draw_trainer_loss),
    Plot(
        "mismatch",
        "Training-inference mismatch KL per step",
        draw_mismatch,
        note="The KL between the inference server's and the trainer's logprobs of the same "
        "sampled tokens, on on-policy samples only (dispatched under the weights the trainer "
        "held), with and without router replay.",
    ),
    Plot("clipped", "Clipped share of loss tokens per step", draw_clipped),
)


def plots_for(records: RunRecords) -> tuple[Plot, ...]:
    """The run's plots: `PLOTS`, with `TRAINER_PLOTS` after the reward plot when the
    trainer wrote step lines."""
    if not records.trainer:
        return PLOTS
    at = [plot.name for plot in PLOTS].index("reward") + 1
    return (*PLOTS[:at], *TRAINER_PLOTS, *PLOTS[at:])


_STYLE: dict[RcKeyType, Any] = {
    "svg.fonttype": "none",  # text stays text: small, selectable
    "font.size": 9,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "figure.dpi": 100,
}


def _finish(ax: Axes, plot: Plot, drew: bool, records: RunRecords) -> None:
    ax.set_title(plot.title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and versions
    if not drew:
        text = plot.empty_text(records)
        ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    elif ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8)


def plot_svg(plot: Plot, records: RunRecords) -> tuple[str, bool]:
    """`plot` as an `<svg>` element for inline use, and whether it had data."""
    style: dict[RcKeyType, Any] = {**_STYLE, "svg.hashsalt": plot.name}
    with matplotlib.rc_context(style):
        figure = Figure(figsize=(6.4, 3.4), layout="constrained")
        ax = figure.add_subplot()
        drew = plot.draw(ax, records)
        _finish(ax, plot, drew, records)
        buffer = io.StringIO()
        figure.savefig(buffer, format="svg", metadata={"Date": None})
    text = buffer.getvalue()
    # The XML prolog and matplotlib's RDF metadata block have no place inside a page.
    svg = _METADATA.sub("", text[text.index("<svg") :], count=1)
    return svg, drew


def plots_png(records: RunRecords) -> bytes:
    """Every plot of the run (`plots_for`) on one PNG, two to a row."""
    plots = plots_for(records)
    with matplotlib.rc_context(_STYLE):
        rows = (len(plots) + 1) // 2
        figure = Figure(figsize=(12.8, 3.4 * rows), layout="constrained")
        for index, plot in enumerate(plots):
            ax = figure.add_subplot(rows, 2, index + 1)
            _finish(ax, plot, plot.draw(ax, records), records)
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png", metadata={"Software": None})
    return buffer.getvalue()

"""`orchestrator report`: the run's records read back (torn and foreign lines passed over,
a resumed run's repeated steps), every plot drawn or marked empty, the trainer's plots
from its `trainer.jsonl` (only when there is one), the page and the PNG, and the
command's one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from cli_kit import refused
from matplotlib.figure import Figure
from run_kit import write_run_toml

from orchestrator.cli import main
from orchestrator.report import PLOTS, read_records, write_report
from orchestrator.report.figures import TRAINER_PLOTS, _deltas, draw_mismatch, plot_svg
from orchestrator.report.page import render_html
from orchestrator.report.records import TRAINER_FORMAT


def step_line(step: int, **more: Any) -> dict[str, Any]:
    line = {
        "step": step,
        "time": 1000.0 + 2 * step,
        "version": step - 1,
        "samples": 16,
        "reward_mean": 0.1 * step,
        "reward_by_env": {"arith": 0.1 * step, "chat": 0.05 * step},
        "staleness_max": 2,
        "staleness_mean": 1.5,
        "rollouts": {"completed": 20 * step},
        "failures": {},
        "discards": {"swept": 4 * step, "stale": step},
        "inflight_limit": 32,
        "payload_bytes": 1 << 20,
        "payload_files": 10,
        "bytes_deleted": {"collection": (1 << 19) * step},
        "files_deleted": {"collection": 5 * step},
        "collected_below": max(0, step - 3),
    }
    line.update(more)
    return line


def eval_line(version: int, reward: float) -> dict[str, Any]:
    return {
        "version": version,
        "step": version,
        "started_at": 1000.0,
        "duration_s": 1.0,
        "resumed": False,
        "envs": {
            "arith-eval": {
                "samples": 8,
                "failed": 0,
                "prompts": 4,
                "reward_mean": reward,
                "pass_at": {"1": reward, "2": min(1.0, 2 * reward)},
                "completion_tokens_mean": 12.5,
                "completion_tokens_max": 16,
                "versions": [version],
                "failures": {},
            }
        },
    }


def trainer_line(step: int, **more: Any) -> dict[str, Any]:
    line = {
        "format": TRAINER_FORMAT,
        "step": step,
        "version": step - 1,
        "samples": 16,
        "tokens": 230,
        "loss": -0.01 * step,
        "grad_norm": 0.8 / step,
        "clipped_share": 0.01 * step,
        "reward_mean": 0.1 * step,
        "seconds": 1.7,
        "on_policy_samples": 6,
        "mismatch_kl": 1e-6 * step,
        "mismatch_kl_no_replay": 1e-3 * step,
        "mismatch_by_server": {"http://127.0.0.1:8000": 1e-6 * step},
        "time": 1000.0 + 2 * step,
    }
    line.update(more)
    return line


def write_trainer(run_dir: Path, lines: list[Any]) -> None:
    (run_dir / "trainer.jsonl").write_text(
        "".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines)
    )


def write_run(run_dir: Path, steps: list[Any], evals: list[Any]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, lines in (("steps.jsonl", steps), ("evals.jsonl", evals)):
        (run_dir / name).write_text(
            "".join(line if isinstance(line, str) else json.dumps(line) + "\n" for line in lines)
        )


def records_of(run_dir: Path):  # type: ignore[no-untyped-def]
    return read_records(
        run_dir,
        steps_file=run_dir / "steps.jsonl",
        evals_file=run_dir / "evals.jsonl",
        state_dir=run_dir / "orchestrator",
    )


def test_torn_and_foreign_lines_are_counted_and_passed_over(tmp_path: Path) -> None:
    write_run(
        tmp_path,
        [step_line(1), "not json\n", "[1, 2]\n", json.dumps({"step": "two"}) + "\n", step_line(2)],
        [eval_line(0, 0.1), '{"version": 2, "envs": {"a": 1}}\n', '{"version": 4, "en'],
    )
    records = records_of(tmp_path)
    assert [row["step"] for row in records.step_rows] == [1, 2]
    assert [line["version"] for line in records.evals] == [0]
    assert records.skipped_lines == 5
    assert "5 line(s) of the run's records could not be read" in render_html(records, title="t")


def test_a_resumed_run_s_repeated_step_counts_once_and_its_restarted_totals_are_no_drop(
    tmp_path: Path,
) -> None:
    # Steps 1-3, then a resumed run shipped 3 again and 4, counting from zero.
    write_run(
        tmp_path,
        [
            step_line(1),
            step_line(2),
            step_line(3),
            step_line(3, rollouts={"completed": 10}),
            step_line(4, rollouts={"completed": 30}),
        ],
        [],
    )
    records = records_of(tmp_path)
    assert [row["step"] for row in records.step_rows] == [1, 2, 3, 4]
    assert records.step_rows[2]["rollouts"] == {"completed": 10}
    assert _deltas([20, 40, 60, 10, 30]) == [20, 20, 20, None, 20]


def test_every_plot_is_drawn_from_the_records(tmp_path: Path) -> None:
    write_run(tmp_path, [step_line(s) for s in range(1, 6)], [eval_line(0, 0.1), eval_line(4, 0.4)])
    records = records_of(tmp_path)
    for plot in PLOTS:
        svg, drew = plot_svg(plot, records)
        assert drew, plot.name
        assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
        assert plot.title in svg  # text stays text (svg.fonttype none)
    page = render_html(records, title="Run demo")
    figures = re.findall(r'<figure id="(\w+)" data-plot="\w+">\s*<svg', page)
    assert figures == [plot.name for plot in PLOTS]
    # Self-contained: no script, nothing it would fetch.
    assert "<script" not in page and "<metadata>" not in page
    assert re.search(r'(src|href)="(https?:|//)', page) is None
    # The eval table: one row per eval and env, pass@k columns.
    assert page.count("<td class=env>arith-eval</td>") == 2
    assert "<th>pass@1</th><th>pass@2</th>" in page


def test_a_run_with_nothing_recorded_yet_still_has_its_page(tmp_path: Path) -> None:
    tmp_path.mkdir(exist_ok=True)
    records = records_of(tmp_path)
    page = render_html(records, title="Run empty")
    assert page.count('class="empty"') == len(PLOTS)
    assert page.count("nothing recorded yet") == len(PLOTS)
    assert "no batch shipped yet" in page and "No evals" in page


def test_the_png_holds_every_plot(tmp_path: Path) -> None:
    write_run(tmp_path, [step_line(s) for s in range(1, 4)], [eval_line(0, 0.2)])
    out = write_report(records_of(tmp_path), tmp_path / "r.png", fmt="png", title="t")
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000
    assert not list(tmp_path.glob(".r.png.*"))  # no temporary file left


def config_file(tmp_path: Path) -> Path:
    return write_run_toml(tmp_path / "run.toml", tmp_path / "run")


def test_the_command_writes_the_page_next_to_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_run(tmp_path / "run", [step_line(1), step_line(2)], [eval_line(0, 0.1)])
    assert main(["report", "--config", str(config_file(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert out.strip() == f"report: {tmp_path / 'run' / 'report.html'} (2 steps, 1 evals)"
    assert (tmp_path / "run" / "report.html").read_text().startswith("<!DOCTYPE html>")
    png = tmp_path / "elsewhere" / "curves.png"
    assert main(["report", "--config", str(config_file(tmp_path)), "--out", str(png)]) == 0
    assert png.read_bytes().startswith(b"\x89PNG")


def test_the_command_s_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(capsys, "report", "--config", str(config_file(tmp_path)))
    assert "does not exist: nothing to report" in err
    write_run(tmp_path / "run", [step_line(1)], [])
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "report.html"
    err = refused(capsys, "report", "--config", str(config_file(tmp_path)), "--out", str(out))
    assert "cannot write the report to" in err


def figure_ids(page: str) -> list[str]:
    return re.findall(r'<figure id="(\w+)" data-plot="\w+"[^>]*>\s*<svg', page)


def test_the_trainer_s_lines_are_drawn_beside_the_reward(tmp_path: Path) -> None:
    write_run(tmp_path, [step_line(s) for s in range(1, 5)], [eval_line(0, 0.1)])
    no_on_policy = trainer_line(3, on_policy_samples=0, mismatch_kl=None)
    no_on_policy["mismatch_kl_no_replay"] = None
    write_trainer(
        tmp_path,
        [
            trainer_line(1),
            trainer_line(2, loss=5.0),
            '{"format": "rollout-orchestrator.trainer-step/1", "step": 3, "lo\n',  # torn
            trainer_line(2),  # a resumed trainer's step 2 again: the last one counts
            {**trainer_line(4), "format": "some-other-trainer/2"},
            no_on_policy,
            trainer_line(4),
        ],
    )
    records = records_of(tmp_path)
    assert [row["step"] for row in records.trainer_rows] == [1, 2, 3, 4]
    assert records.trainer_rows[1]["loss"] == -0.02
    assert records.skipped_lines == 2
    for plot in TRAINER_PLOTS:
        svg, drew = plot_svg(plot, records)
        assert drew and plot.title in svg, plot.name
    page = render_html(records, title="Run demo")
    names = [plot.name for plot in PLOTS]
    assert figure_ids(page) == [names[0], "loss", "mismatch", "clipped", *names[1:]]
    assert 'class="empty"' not in page
    assert "2 line(s) of the run's records could not be read" in page
    assert "from steps.jsonl, evals.jsonl, trainer.jsonl and progress.json" in page
    # The note is under the mismatch figure, and only there.
    mismatch = re.search(r'<figure id="mismatch".*?</figure>', page, re.DOTALL)
    assert mismatch is not None and page.count("<figcaption") == 1
    assert re.search(r'</svg>\s*<figcaption class="note">The KL between', mismatch.group())
    assert "on-policy samples only" in mismatch.group()
    png = write_report(records, tmp_path / "r.png", fmt="png", title="t")
    assert png.read_bytes().startswith(b"\x89PNG")


def test_without_trainer_jsonl_the_page_is_as_before(tmp_path: Path) -> None:
    write_run(tmp_path, [step_line(s) for s in range(1, 4)], [eval_line(0, 0.2)])
    records = records_of(tmp_path)
    assert records.trainer == () and records.skipped_lines == 0
    page = render_html(records, title="t")
    assert figure_ids(page) == [plot.name for plot in PLOTS]
    assert "<figcaption" not in page and "trainer.jsonl" not in page
    assert "from steps.jsonl, evals.jsonl and progress.json" in page
    # A file with no line of the known format draws nothing either; its lines are counted.
    write_trainer(tmp_path, ["garbage\n", {**trainer_line(1), "format": "x/1"}])
    records = records_of(tmp_path)
    assert records.trainer == () and records.skipped_lines == 2
    assert figure_ids(render_html(records, title="t")) == [plot.name for plot in PLOTS]


def mismatch_lines(records: Any) -> dict[str, tuple[list[int], list[float]]]:
    ax = Figure().add_subplot()
    assert draw_mismatch(ax, records)
    assert ax.get_yscale() == "log"
    return {
        str(line.get_label()): (list(line.get_xdata()), list(line.get_ydata()))  # type: ignore[arg-type]
        for line in ax.get_lines()
    }


def test_a_null_mismatch_point_is_left_out_of_its_line(tmp_path: Path) -> None:
    write_run(tmp_path, [], [])
    write_trainer(
        tmp_path,
        [
            trainer_line(1),
            trainer_line(2, mismatch_kl=None, mismatch_kl_no_replay=None, on_policy_samples=0),
            trainer_line(3, mismatch_kl_no_replay=None),
            trainer_line(4),
        ],
    )
    lines = mismatch_lines(records_of(tmp_path))
    assert lines["with router replay"] == ([1, 3, 4], [1e-6, 3e-6, 4e-6])
    assert lines["without router replay"] == ([1, 4], [1e-3, 4e-3])


def test_an_all_null_no_replay_series_is_left_out(tmp_path: Path) -> None:
    write_run(tmp_path, [], [])
    write_trainer(tmp_path, [trainer_line(s, mismatch_kl_no_replay=None) for s in range(1, 4)])
    records = records_of(tmp_path)
    assert list(mismatch_lines(records)) == ["with router replay"]
    svg, drew = plot_svg(TRAINER_PLOTS[1], records)
    assert drew and "with router replay" in svg and "without router replay" not in svg
    # No KL at all (no on-policy samples yet): the plot is there, marked empty.
    write_trainer(tmp_path, [trainer_line(1, mismatch_kl=None, mismatch_kl_no_replay=None)])
    records = records_of(tmp_path)
    page = render_html(records, title="t")
    assert re.search(r'<figure id="mismatch" data-plot="mismatch" class="empty">', page)
    assert page.count('class="empty"') == 1 + len(PLOTS)  # and every run plot: no steps


def test_a_finished_run_without_discards_says_so(tmp_path: Path) -> None:
    write_run(tmp_path, [step_line(s, discards={"stale": 0, "swept": 0}) for s in range(1, 4)], [])
    page = render_html(records_of(tmp_path), title="Run clean")
    assert re.search(r'<figure id="discards" data-plot="discards" class="empty">', page)
    assert "no discards in 3 steps" in page
    # The evals' plot has nothing for other reasons: it still says nothing was recorded.
    assert page.count("nothing recorded yet") == 1

"""The report of a real run, opened in a real browser: headless Chromium (Debian's, driven
by Playwright) renders `report.html` from a file with the network closed; the page has
every plot, each drawn at a real size, the eval table, and no script error or failed
request. A screenshot goes next to the test's files (and to `ORCH_BROWSER_SHOTS` when
set, to look at).

Runs only in `make test-browser` (tests/browser/run.sh), which installs Chromium and
Playwright and sets `ORCH_BROWSER`.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import trio
from demo_run import DEMO_CONFIG, demo_paths
from playwright.sync_api import ConsoleMessage, Request, sync_playwright

from orchestrator.cli import main
from orchestrator.commands.launch import launch_run
from orchestrator.config import load_config
from orchestrator.report import PLOTS

# As the machine's notes give them: root needs --no-sandbox, and the closed network
# refuses Chromium's background connections.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def test_the_report_of_a_demo_run_renders_in_chromium(tmp_path: Path) -> None:
    overrides = [
        *demo_paths(tmp_path / "run"),
        "max_steps=6",
        "eval.interval=3",
        "eval.num_examples=8",
        "sim.train_time_s=0.05",
        "trainer.poll_interval_s=0.1",
        # Groups that scored little are discarded, so the discards plot has data: the
        # demo's own six steps, each batch filled by exactly the groups it needs, may
        # discard none. Random tokens score 0.1 to 0.2 a batch on the demo's partial
        # reward; a group of four under 0.05 is common (a group that scores nothing at
        # all is not: six steps may have none).
        "batch.curriculum_min_mean_reward=0.05",
    ]
    trio.run(launch_run, load_config(DEMO_CONFIG, overrides))
    sets = [arg for override in overrides for arg in ("--set", override)]
    assert main(["report", "--config", str(DEMO_CONFIG), *sets]) == 0
    page_path = tmp_path / "run" / "report.html"

    errors: list[str] = []
    requests: list[str] = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=os.environ["ORCH_BROWSER"], args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("pageerror", lambda exc: errors.append(f"page error: {exc}"))

            def console(message: ConsoleMessage) -> None:
                if message.type == "error":
                    errors.append(f"console: {message.text}")

            def request(sent: Request) -> None:
                if not sent.url.startswith("file://"):
                    requests.append(sent.url)

            page.on("console", console)
            page.on("request", request)
            page.goto(page_path.as_uri(), wait_until="load")
            figures = page.locator("figure[data-plot]")
            assert figures.count() == len(PLOTS)
            for plot in PLOTS:
                svg = page.locator(f"figure#{plot.name} svg")
                box = svg.bounding_box()
                assert box is not None and box["width"] > 300 and box["height"] > 120, plot.name
                # Every plot of a run that shipped and evaluated has its data.
                assert "empty" not in (
                    page.locator(f"figure#{plot.name}").get_attribute("class") or ""
                )
                assert svg.locator("path").count() > 10, plot.name
            assert page.locator("h1").inner_text() == "Run run"
            # The evals at versions 0, 3 and 6, one row each for the one eval env.
            assert page.locator("table tbody tr").count() == 3
            shot = tmp_path / "report.png"
            page.screenshot(path=str(shot), full_page=True)
        finally:
            browser.close()
    assert errors == [] and requests == []
    assert shot.stat().st_size > 50_000
    shots = os.environ.get("ORCH_BROWSER_SHOTS")
    if shots:
        Path(shots).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(shots) / "report.png")

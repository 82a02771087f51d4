"""The console for people (orchestrator/logs/console.py): one short line per event on a
terminal, JSON lines unchanged for files and pipes. The pty test runs a real process on a
pseudo-terminal and the same one on a pipe."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog

from orchestrator.logs import console_processors

# A shipped batch as the shipper logs it (the demo's step 2), and its neighbours.
SHIPPED: dict[str, Any] = {
    "step": 2,
    "version": 1,
    "samples": 16,
    "groups": 4,
    "staleness": 1,
    "discards": {
        "stale": 0,
        "swept": 3,
        "no_signal": 12,
        "curriculum": 0,
        "untrainable": 0,
        "pruned": 0,
        "failed": 0,
        "reward_failed": 0,
    },
    "files_deleted": 15,
    "payload_files": 36,
    "payload_bytes": 695792,
    "batch": "/somewhere/run/demo/batches/step_000002",
}


def console(event: str, level: str = "info", **fields: Any) -> str | None:
    """`event` rendered through the console's chain (None: left out)."""
    rendered: Any = {"event": event, "level": level, "timestamp": "01:28:33", **fields}
    for processor in console_processors(colors=False):
        try:
            rendered = processor(None, level, rendered)
        except structlog.DropEvent:
            return None
    assert isinstance(rendered, str)
    return rendered


def test_a_shipped_step_is_one_line_with_only_its_nonzero_discards() -> None:
    assert console("shipped batch", **SHIPPED) == (
        "01:28:33 [info] step 2 shipped: v1, 16 samples (4 groups, staleness 1); "
        "run so far: discards no_signal 12, swept 3, 15 files deleted; "
        "disk 36 files / 679.5 KiB"
    )
    quiet = {**SHIPPED, "discards": dict.fromkeys(SHIPPED["discards"], 0)}
    line = console("shipped batch", **quiet)
    assert line is not None and "no discards" in line and "swept" not in line


def test_an_applied_version_is_one_line_naming_its_servers() -> None:
    servers = ["http://127.0.0.1:35167", "http://127.0.0.1:40067"]
    assert console("applied version", version=3, previous=2, bound=1, servers=servers) == (
        "01:28:33 [info] v3 applied on 127.0.0.1:35167, 127.0.0.1:40067; collection bound v1"
    )
    # Each server's own line is left out; a collection of nothing too.
    assert console("weights updated", url=servers[0], weight_dir="/w/step_3", version=3) is None
    assert (
        console("collected", bound=-1, dirs=0, files=0, bytes=0, payload_bytes=9, duration_s=0.1)
        is None
    )
    assert console(
        "collected", bound=1, dirs=1, files=44, bytes=853132, payload_bytes=87836, duration_s=0.33
    ) == ("01:28:33 [info] collected below v1: 1 dir, 44 files, 833.1 KiB in 0.33 s; disk 85.8 KiB")


def test_other_events_and_warnings_read_as_words() -> None:
    line = console(
        "no batch shipped",
        level="warning",
        quiet_s=60.0,
        since="start",
        discards={"no_signal": 400, "stale": 0},
        failures={},
        top_error=None,
        payload_root=os.path.join(os.getcwd(), "run", "demo", "payloads"),
    )
    assert line == (
        "01:28:33 [warning] no batch shipped: quiet 60.0 s; since start; "
        "discards no_signal 400; failures none; top error none; payload root run/demo/payloads"
    )
    # An event without the fields its own form expects falls back to the words.
    assert console("shipped batch", step=1) == "01:28:33 [info] shipped batch: step 1"
    assert console("x", detail="y" * 500) == "01:28:33 [info] x: detail " + "y" * 159 + "…"


SCRIPT = f"""
from orchestrator.logs import configure_logging
import structlog
configure_logging()
structlog.get_logger("t").info("shipped batch", **{SHIPPED!r})
structlog.get_logger("t").info("weights updated", url="http://h:1", weight_dir="/w", version=1)
"""


def run_on_pty(tmp_path: Path) -> str:
    """The script's stderr when it is a pseudo-terminal."""
    controller, terminal = pty.openpty()
    with subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal
    ) as process:
        os.close(terminal)
        chunks = []
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            chunks.append(chunk)
        assert process.wait(timeout=30) == 0
    os.close(controller)
    return b"".join(chunks).decode()


@pytest.mark.skipif(not hasattr(pty, "openpty"), reason="needs a pseudo-terminal")
def test_a_terminal_gets_the_console_and_a_pipe_the_json_lines(tmp_path: Path) -> None:
    import re

    shown = re.sub(r"\x1b\[[0-9;]*m", "", run_on_pty(tmp_path))
    lines = [line for line in shown.splitlines() if line.strip()]
    assert len(lines) == 1, shown
    assert re.fullmatch(r"\d\d:\d\d:\d\d \[info\] step 2 shipped: v1, 16 samples .*", lines[0])
    piped = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=30
    )
    records = [json.loads(line) for line in piped.stderr.splitlines()]
    assert [r["event"] for r in records] == ["shipped batch", "weights updated"]
    assert {k: records[0][k] for k in SHIPPED} == SHIPPED
    assert set(records[0]) == {*SHIPPED, "event", "level", "timestamp"}
    assert records[0]["timestamp"].endswith("Z")

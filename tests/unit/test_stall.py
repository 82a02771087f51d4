"""The stall watch: warn when no batch has shipped for `stall_warning_s`, once per
interval, with the step, queued vs needed samples, and the discards, failures and most
common error since the last shipped batch. The service runs on trio's virtual clock."""

from __future__ import annotations

from typing import Any

import pytest
import structlog.testing
import trio
import trio.testing

from orchestrator.daemon.rejections import TopError
from orchestrator.daemon.reporting.run_snapshot import RunSnapshot
from orchestrator.daemon.reporting.stall import StallWatch, most_discarded, serve_stall_watch


def figures(
    *,
    discards: dict[str, int] | None = None,
    failures: dict[str, int] | None = None,
    texts: dict[tuple[str, str], int] | None = None,
    idle: bool = False,
    gate_open: bool = True,
    settling: bool = False,
) -> RunSnapshot:
    return RunSnapshot(
        step=3,
        queued=5,
        needed=16,
        gate_open=gate_open,
        applied_version=1,
        idle=idle,
        discards=discards or {},
        failures=failures or {},
        texts=texts or {},
        settling=settling,
    )


def test_no_warning_before_the_interval_then_one_per_interval() -> None:
    watch = StallWatch(stall_s=60.0, started_at=100.0)
    quiet = figures(discards={"untrainable": 4512, "stale": 0})
    assert watch.check(159.9, quiet) is None
    report = watch.check(160.0, quiet)
    assert report is not None
    assert report.quiet_s == 60.0 and not report.shipped_before
    assert (report.step, report.queued, report.needed) == (3, 5, 16)
    assert report.recent.discards == {"untrainable": 4512}
    fields = report.log_fields()
    assert fields["since"] == "start"
    assert "max_seq_len" in fields["hint"]
    # Once per interval, not at every check.
    assert watch.check(200.0, quiet) is None
    assert watch.next_check(200.0) == 220.0
    assert watch.check(220.0, quiet) is not None


def test_untrainable_from_refused_payloads_names_the_refusal_not_the_length() -> None:
    # A server without routing capture: every reply poisoned, every rollout untrainable.
    # The hint once blamed samples longer than batch.max_seq_len.
    no_capture = "the reply carries no routed_experts: is routing capture on in the server"
    watch = StallWatch(stall_s=60.0, started_at=100.0)
    quiet = figures(
        discards={"untrainable": 4300},
        failures={"poisoned_payload": 4300},
        texts={("poisoned_payload", no_capture): 4300, ("http_5xx", "HTTP 500"): 2},
    )
    report = watch.check(160.0, quiet)
    assert report is not None
    hint = report.log_fields()["hint"]
    assert "max_seq_len" not in hint
    assert "payloads were refused (4300 replies)" in hint and no_capture in hint
    # A few refusals beside many samples that are too long: the generic hint stands.
    mostly_long = figures(
        discards={"untrainable": 4300},
        failures={"poisoned_payload": 3},
        texts={("poisoned_payload", no_capture): 3},
    )
    report = StallWatch(stall_s=60.0, started_at=100.0).check(160.0, mostly_long)
    assert report is not None and "max_seq_len" in report.log_fields()["hint"]


@pytest.mark.parametrize(
    ("discards", "hint"),
    [
        # Every sample too long, behind a majority of groups without signal (counted
        # whole under no_signal): the length is what keeps batches from filling.
        (
            {"no_signal": 700, "curriculum": 50, "untrainable": 300},
            "most discards besides no_signal and curriculum are untrainable: samples longer",
        ),
        ({"no_signal": 700, "stale": 3}, "besides no_signal and curriculum are stale"),
        # Nothing but groups their rewards discard: that is the cause.
        ({"no_signal": 700, "curriculum": 50}, "most discards are no_signal: groups whose"),
        ({"untrainable": 300, "stale": 3}, "most discards are untrainable: samples longer"),
    ],
)
def test_the_hint_names_what_took_the_groups_with_signal(
    discards: dict[str, int], hint: str
) -> None:
    report = StallWatch(stall_s=60.0, started_at=100.0).check(160.0, figures(discards=discards))
    assert report is not None
    assert hint in report.log_fields()["hint"]


def test_a_shipped_batch_restarts_the_clock_and_the_counts() -> None:
    watch = StallWatch(stall_s=10.0, started_at=0.0)
    at_ship = figures(
        discards={"pruned": 40, "untrainable": 1},
        failures={"http_5xx": 7},
        texts={("http_5xx", "HTTP 500"): 7},
    )
    watch.shipped(5.0, at_ship)
    assert watch.check(14.0, at_ship) is None
    assert watch.next_check(6.0) == 15.0
    later = figures(
        discards={"pruned": 40, "untrainable": 9},
        failures={"http_5xx": 8, "malformed": 900},
        texts={("http_5xx", "HTTP 500"): 8, ("malformed", "not JSON"): 900},
    )
    report = watch.check(15.0, later)
    assert report is not None and report.shipped_before
    # Only what happened since the last shipped batch.
    assert report.recent.discards == {"untrainable": 8}
    assert report.recent.failures == {"http_5xx": 1, "malformed": 900}
    assert report.recent.top_error == TopError("malformed", "not JSON", 900)
    assert report.log_fields()["top_error"] == "malformed: not JSON (900x)"


def test_nothing_to_ship_is_not_a_stall_and_zero_turns_it_off() -> None:
    watch = StallWatch(stall_s=10.0, started_at=0.0)
    assert watch.check(100.0, figures(idle=True)) is None
    assert watch.next_check(100.0) > 100.0
    off = StallWatch(stall_s=0.0, started_at=0.0)
    assert off.check(1e9, figures()) is None


def test_a_closed_gate_says_the_batch_waits_for_the_trainer() -> None:
    watch = StallWatch(stall_s=1.0, started_at=0.0)
    report = watch.check(2.0, figures(gate_open=False))
    assert report is not None
    assert "trainer" in report.log_fields()["waiting_for"]


def test_a_closed_gate_behind_an_unfinished_update_names_the_update_not_the_trainer() -> None:
    # A collection waiting for the payload root's lock kept the watcher from the next
    # version while the warning blamed the trainer.
    watch = StallWatch(stall_s=1.0, started_at=0.0)
    report = watch.check(2.0, figures(gate_open=False, settling=True))
    assert report is not None
    waiting = report.log_fields()["waiting_for"]
    assert "update to v1" in waiting and "collection" in waiting
    assert "trainer" not in waiting


def test_most_discarded() -> None:
    assert most_discarded({"stale": 1, "untrainable": 4512, "pruned": 0}) == ("untrainable", 4512)
    assert most_discarded({"stale": 0}) is None
    assert most_discarded({}) is None


async def test_the_service_warns_on_virtual_time_and_saves_progress(
    autojump_clock: trio.testing.MockClock,
) -> None:
    watch = StallWatch(stall_s=60.0, started_at=trio.current_time())
    current = figures(discards={"untrainable": 4512})
    saves: list[float] = []

    async def save() -> None:
        saves.append(trio.current_time())

    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_stall_watch, watch, lambda: current, save)
            await trio.sleep(59)
            assert warnings(logs) == []
            await trio.sleep(2)
            assert len(warnings(logs)) == 1
            # A batch ships at 100 s: quiet again until 160 s.
            await trio.sleep(39)
            watch.shipped(trio.current_time(), current)
            await trio.sleep(59)
            assert len(warnings(logs)) == 1
            await trio.sleep(2)
            assert len(warnings(logs)) == 2
            await trio.sleep(120)
            nursery.cancel_scope.cancel()
    lines = warnings(logs)
    assert len(lines) == 4  # at 60 s, 160 s, 220 s, 280 s
    assert saves == [60.0, 160.0, 220.0, 280.0]
    first = lines[0]
    assert first["log_level"] == "warning"
    assert first["step"] == 3 and first["queued_samples"] == 5 and first["needed_samples"] == 16
    assert first["discards"] == {"untrainable": 4512}
    assert lines[1]["since"] == "last shipped batch" and lines[1]["discards"] == {}


def warnings(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry["event"] == "no batch shipped"]

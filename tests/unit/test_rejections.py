"""`Rejections`: every failure counted by kind, its texts remembered within a bound, and
logged at warning level at most once per interval for each (kind, server)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import structlog.testing

from orchestrator.daemon.rejections import TEXT_CHARS, Rejections, TopError, top_error


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def lines(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry["event"] == "rollout failure"]


def test_each_record_counts_its_kind_in_the_shared_counter() -> None:
    counts: Counter[str] = Counter()
    rejections = Rejections(counts, clock=Clock())
    with structlog.testing.capture_logs():
        rejections.record("malformed", "http://a", "not JSON")
        rejections.record("malformed", "http://b", "not JSON")
        rejections.record("timeout", "http://a", "no answer in time")
    assert counts == Counter(malformed=2, timeout=1)


def test_the_first_line_is_at_once_then_one_per_interval_with_what_was_left_out() -> None:
    clock = Clock()
    rejections = Rejections(clock=clock, log_interval_s=10.0)
    with structlog.testing.capture_logs() as logs:
        # A server replying garbage 900 times over 90 s (ten a second).
        for i in range(900):
            clock.now = i * 0.1
            rejections.record("malformed", "http://a", "choice without tokens", attempt=1)
    logged = lines(logs)
    assert rejections.counts["malformed"] == 900
    # At 0 s, then at 10 s, 20 s, ... 80 s: nine lines, not 900.
    assert len(logged) == 9
    assert all(entry["log_level"] == "warning" for entry in logged)
    first = logged[0]
    assert (first["kind"], first["server"], first["detail"]) == (
        "malformed",
        "http://a",
        "choice without tokens",
    )
    assert first["suppressed"] == 0 and first["attempt"] == 1
    # Each later line says how many were left out since the one before it.
    assert all(entry["suppressed"] == 99 for entry in logged[1:])
    assert len(logged) + sum(entry["suppressed"] for entry in logged) + 99 == 900


def test_the_limit_is_per_kind_and_server() -> None:
    rejections = Rejections(clock=Clock())
    with structlog.testing.capture_logs() as logs:
        for _ in range(5):
            rejections.record("malformed", "http://a", "x")
            rejections.record("malformed", "http://b", "x")
            rejections.record("http_5xx", "http://a", "HTTP 500")
    assert [(e["kind"], e["server"]) for e in lines(logs)] == [
        ("malformed", "http://a"),
        ("malformed", "http://b"),
        ("http_5xx", "http://a"),
    ]


def test_texts_are_cut_short_counted_and_bounded_per_kind() -> None:
    rejections = Rejections(clock=Clock(), max_texts=3)
    long = "y" * 500
    with structlog.testing.capture_logs() as logs:
        for _ in range(4):
            rejections.record("malformed", "s", long)
        rejections.record("malformed", "s", "rare")
        for i in range(50):
            rejections.record("malformed", "s", f"unique {i}")
    # The whole detail is logged; only its start is remembered.
    assert lines(logs)[0]["detail"] == long
    common = rejections.most_common("malformed", 10)
    assert len(common) == 3
    assert common[0] == ("y" * TEXT_CHARS, 4)
    assert len(rejections.texts()) == 3
    assert rejections.most_common("timeout") == []


def test_the_top_error_over_every_kind_and_since_an_earlier_point() -> None:
    rejections = Rejections(clock=Clock())
    with structlog.testing.capture_logs():
        for _ in range(3):
            rejections.record("http_5xx", "s", "HTTP 500")
        before = rejections.texts()
        for _ in range(2):
            rejections.record("malformed", "s", "not JSON")
    assert rejections.top_error() == TopError("http_5xx", "HTTP 500", 3)
    assert rejections.top_error(since=before) == TopError("malformed", "not JSON", 2)
    assert top_error({}, {}) is None
    assert rejections.top_error(since=rejections.texts()) is None

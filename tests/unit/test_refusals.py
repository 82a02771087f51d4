"""The refusal watch: a fleet that refuses every request with one client error ends the run."""

from __future__ import annotations

from orchestrator.core.refusals import MIN_REFUSALS, RefusalWatch

A, B = "http://a:8000", "http://b:8000"
FLEET = (A, B)


def reason(server: str) -> str:
    return f"{server}/inference/v1/generate: HTTP 400 'this server writes no payloads by handle'"


def refuse_all(watch: RefusalWatch, start: float, end: float, step: float = 1.0) -> str | None:
    """Both servers refuse once per `step` from `start` to `end`; the last answer."""
    now, ended = start, None
    while now <= end:
        for server in FLEET:
            ended = watch.refused(now, server, reason(server), FLEET)
        now += step
    return ended


def test_every_server_refusing_everything_for_the_window_ends_the_run() -> None:
    watch = RefusalWatch(window_s=30.0)
    assert refuse_all(watch, 0.0, 29.0) is None
    ended = watch.refused(30.0, A, reason(A), FLEET)
    assert ended is not None
    assert "every inference server refused every request for 30 s" in ended
    # The reason as the server gave it, in one line.
    assert ended.endswith(reason(A)) and "\n" not in ended


def test_one_answer_starts_the_watch_again() -> None:
    watch = RefusalWatch(window_s=30.0)
    assert refuse_all(watch, 0.0, 20.0) is None
    watch.answered()
    assert refuse_all(watch, 21.0, 50.0) is None  # 29 s since the answer
    assert refuse_all(watch, 51.0, 51.0) is not None


def test_another_reason_starts_the_watch_again() -> None:
    watch = RefusalWatch(window_s=30.0)
    assert refuse_all(watch, 0.0, 20.0) is None
    assert (
        watch.refused(21.0, A, f"{A}/inference/v1/generate: HTTP 404 'no such route'", FLEET)
        is None
    )
    assert refuse_all(watch, 22.0, 51.0) is None
    assert refuse_all(watch, 52.0, 52.0) is not None


def test_a_server_that_never_refused_keeps_the_run_going() -> None:
    watch = RefusalWatch(window_s=30.0)
    for second in range(100):
        assert watch.refused(float(second), A, reason(A), FLEET) is None


def test_a_few_refusals_are_not_enough_however_long_apart() -> None:
    watch = RefusalWatch(window_s=30.0)
    ended = None
    for i in range(MIN_REFUSALS - 1):
        ended = watch.refused(100.0 * i, FLEET[i % 2], reason(FLEET[i % 2]), FLEET)
    assert ended is None
    assert watch.refused(1e6, A, reason(A), FLEET) is not None


def test_zero_never_ends_a_run() -> None:
    watch = RefusalWatch(window_s=0.0)
    assert refuse_all(watch, 0.0, 1000.0, step=10.0) is None

"""The verifiers worker's log filter: a failed model call of a rollout the daemon ended
is expected and dropped; every other warning is kept."""

from __future__ import annotations

import logging

from orchestrator.tasks.verifiers_env.worker import Relay, RolloutOverFilter


def record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(
        "verifiers.v1.interception.server", logging.WARNING, "", 0, msg, args, None
    )


def test_only_failed_calls_of_ended_rollouts_are_dropped() -> None:
    relay = Relay()
    relay.over.add("ended")
    keep = RolloutOverFilter(relay).filter
    failed = "model call failed: id=%s %s: %s"
    assert not keep(record(failed, "ended", "RolloutError", "HTTP 410"))
    assert keep(record(failed, "running", "RolloutError", "HTTP 502"))
    assert keep(record("aux call failed: id=%s %s: %s", "ended", "RolloutError", "x"))
    assert keep(record("model call failed without args"))
    relay.forget(["ended"])
    assert keep(record(failed, "ended", "RolloutError", "HTTP 410"))

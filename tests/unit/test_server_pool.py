"""Server health: down servers get no groups, come back only after loading the applied
version, and every server down for too long is fatal. Virtual time, mock transport."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from scripted_servers import Call, ScriptedServers, answer, refused

from orchestrator.core.staleness import Staleness
from orchestrator.daemon.inference.http11 import Reply
from orchestrator.daemon.inference.server_pool import (
    InferenceUnavailable,
    ProbeSettings,
    ServerPool,
    serve_health_prober,
)
from orchestrator.daemon.run_state import RunState, Shipping, Versions

A, B = "http://a:1", "http://b:2"


def applied(version: int) -> RunState:
    return RunState(Staleness(), Shipping(0), versions=Versions(applied=version))


def settings(tmp_path: Path, deadline: float = 30.0) -> ProbeSettings:
    return ProbeSettings(
        weights_dir=tmp_path / "weights",
        interval_s=1.0,
        request_timeout_s=2.0,
        unavailable_deadline_s=deadline,
    )


async def test_pick_prefers_the_least_loaded_healthy_server() -> None:
    changes: list[int] = []
    pool = ServerPool.of([A + "/", B], on_change=lambda: changes.append(1))
    assert pool.urls == (A, B)
    pool.load[A] = 4
    assert pool.pick() == B
    pool.mark_down(B, "refused")
    pool.mark_down(B, "refused again")  # once is enough
    assert pool.pick() == A and len(changes) == 1
    pool.mark_down(A, "refused")
    assert pool.pick() is None
    pool.mark_up(B)
    assert pool.pick() == B and len(changes) == 3


async def test_a_recovered_server_loads_the_applied_version_before_it_is_used(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    alive = {A: False}
    posted: list[tuple[str, object]] = []

    def handler(call: Call) -> Reply:
        if not alive.get(call.origin, True):
            return refused(call)
        if call.path == "/update_weights":
            posted.append((call.origin, call.json()["weight_dir"]))
        return answer()

    pool = ServerPool.of([A, B], on_change=lambda: None)
    pool.mark_down(A, "refused")
    client = ScriptedServers(handler)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_health_prober, pool, client, settings(tmp_path), applied(7))
        await trio.sleep(5.5)
        assert A in pool.down_since and posted == []
        alive[A] = True
        await trio.sleep(1.0)
        assert A not in pool.down_since
        assert posted == [(A, str(tmp_path / "weights" / "step_000007"))]
        nursery.cancel_scope.cancel()


async def test_every_server_down_past_the_deadline_is_fatal(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    pool = ServerPool.of([A, B], on_change=lambda: None)
    pool.mark_down(A, "refused")
    await trio.sleep(4)
    pool.mark_down(B, "refused")
    start = trio.current_time()
    client = ScriptedServers(refused)
    with pytest.raises(InferenceUnavailable, match="unreachable for 11 s"):
        await serve_health_prober(pool, client, settings(tmp_path, deadline=10.0), applied(0))
    # Counted from the last server going down, checked once a second.
    assert trio.current_time() - start == 11.0

"""Which inference servers are usable: load per server, down servers, and recovery.

A server that refuses connections is marked down: no new group is pinned to it. A prober
checks down servers' `/health`; one that answers again is first told to load the applied
policy version (a restarted server has lost it), then marked up. A server that is down
is not waited for by policy updates; it catches up when it recovers. Every server down
for longer than the deadline is fatal: the run stops with one clear error.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import structlog
import trio

from orchestrator.daemon.inference.client import load_weights
from orchestrator.daemon.inference.http11 import HTTPFailure, Requester
from orchestrator.daemon.run_state import RunState
from orchestrator.wire import HEALTH_PATH, InferenceFailure, WeightUpdate, weight_update_plan

if TYPE_CHECKING:
    from orchestrator.handoff import StepLayout

log = structlog.get_logger(__name__)


class InferenceUnavailable(Exception):
    """Inference servers did not answer within the configured deadline."""


@attrs.define
class ServerPool:
    """The servers of a run, their load (rollouts pinned) and which are down."""

    urls: tuple[str, ...]
    load: Counter[str] = attrs.field(factory=Counter)
    # url -> trio.current_time() when it was marked down.
    down_since: dict[str, float] = attrs.field(factory=dict)
    on_change: Callable[[], None] = lambda: None
    # Servers that answered fewer choices than a request's `n` asked for: each rollout
    # sends them its own first request (`inference.group_request` for them alone).
    ignoring_n: set[str] = attrs.field(factory=set)

    @classmethod
    def of(cls, urls: Sequence[str], on_change: Callable[[], None]) -> ServerPool:
        return cls(tuple(url.rstrip("/") for url in urls), on_change=on_change)

    def healthy(self) -> list[str]:
        return [url for url in self.urls if url not in self.down_since]

    def pick(self) -> str | None:
        """The least loaded healthy server, or None when every server is down."""
        healthy = self.healthy()
        return min(healthy, key=lambda url: self.load[url]) if healthy else None

    def pin(self, url: str, rollouts: int) -> None:
        """`rollouts` more run on `url` (what `pick` weighs)."""
        self.load[url] += rollouts

    def unpin(self, url: str, rollouts: int) -> None:
        """`rollouts` that ran on `url` ended."""
        self.load[url] -= rollouts

    def mark_down(self, url: str, reason: str) -> None:
        if url not in self.down_since:
            self.down_since[url] = trio.current_time()
            log.warning("inference server down", url=url, reason=reason)
            self.on_change()

    def mark_up(self, url: str) -> None:
        if self.down_since.pop(url, None) is not None:
            log.info("inference server back", url=url)
            self.on_change()

    def ignores_n(self, url: str) -> bool:
        """Whether `url` answered fewer choices than asked: no group request goes to it."""
        return url in self.ignoring_n

    def note_ignores_n(self, url: str, asked: int, got: int) -> None:
        """`url` answered `got` choices for `n = asked`: from now on each rollout sends
        it its own first request (the other servers keep group requests). Said once."""
        if url in self.ignoring_n:
            return
        self.ignoring_n.add(url)
        log.warning(
            "inference server ignores n",
            url=url,
            asked=asked,
            answered=got,
            now="each rollout of a group sends this server its own first request; the "
            "other servers keep inference.group_request (set it to false to send every "
            "server one request per rollout)",
        )

    def all_down_for(self) -> float | None:
        """Seconds since the last server went down, when every server is down."""
        if not self.urls or len(self.down_since) < len(self.urls):
            return None
        return trio.current_time() - max(self.down_since.values())


async def probe_health(client: Requester, url: str) -> bool:
    """Whether `url` answers `GET /health` with 200. The caller sets the deadline."""
    try:
        response = await client.request("GET", url + HEALTH_PATH)
    except HTTPFailure:
        return False
    return response.status == 200


@attrs.frozen
class ProbeSettings:
    """How the prober checks down servers, and where the applied version's weights are
    (`weights_dir`, its step directories named by `weights_layout`)."""

    weights_dir: Path
    interval_s: float
    request_timeout_s: float
    unavailable_deadline_s: float
    weights_layout: StepLayout = "native"
    weight_update: WeightUpdate = "prime-rl"
    # How long loading the applied version may take (a checkpoint from disk: minutes).
    load_timeout_s: float = 600.0


async def serve_health_prober(
    pool: ServerPool,
    client: Requester,
    settings: ProbeSettings,
    state: RunState,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Bring recovered servers back (after loading the applied version) until cancelled.

    Raises `InferenceUnavailable` when every server has been down for longer than
    `unavailable_deadline_s`.
    """
    from orchestrator.handoff import weights_step_dir

    task_status.started()
    while True:
        await trio.sleep(settings.interval_s)
        for url in list(pool.down_since):
            healthy = False
            with trio.move_on_after(settings.request_timeout_s):
                healthy = await probe_health(client, url)
            if not healthy:
                continue
            version = state.versions.applied
            with trio.move_on_after(settings.load_timeout_s):
                if version > 0:
                    weight_dir = weights_step_dir(
                        settings.weights_dir, version, layout=settings.weights_layout
                    )
                    plan = weight_update_plan(settings.weight_update, weight_dir, version)
                    try:
                        await load_weights(client, url, plan)
                    except InferenceFailure as exc:
                        log.warning("recovering server refused weights", url=url, error=str(exc))
                        continue
                # A policy update that ran meanwhile skipped this server: try again.
                if state.versions.applied == version:
                    pool.mark_up(url)
        down_for = pool.all_down_for()
        if down_for is not None and down_for > settings.unavailable_deadline_s:
            raise InferenceUnavailable(
                f"every inference server has been unreachable for {down_for:.0f} s "
                f"(inference.unavailable_deadline_s = {settings.unavailable_deadline_s:g}): "
                + ", ".join(pool.urls)
            )

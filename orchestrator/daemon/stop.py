"""Stopping a daemon from outside: the first request stops it gracefully, a second at once.

`orchestrator run` turns SIGINT and SIGTERM into `Stop.request`; `run_daemon(stop=...)`
runs inside `Stop.scope`, whose cancellation ends the run, and returns its outcome marked
`stopped`:

- during start-up (before dispatching began) the start-up is cancelled at once: there is
  nothing in flight to finish;
- once dispatching, no new group starts and every group in flight ends after the request
  each of its rollouts has in flight (so the payload files they write are complete),
  for at most `shutdown.grace_s`; then everything still running is cancelled and
  `progress.json` is saved;
- a second request ends the graceful part at once ("second signal: stopping now"): the
  groups in flight are cancelled without waiting.

Either way no file is left half-written: every file is written under a temporary name
and renamed into place, and a worker thread that is writing one finishes it first.
"""

from __future__ import annotations

import math

import attrs
import structlog
import trio

log = structlog.get_logger(__name__)


@attrs.define(eq=False)
class Stop:
    """A stop asked of one run. Create it inside `trio.run`."""

    grace_s: float
    # The run: `run_daemon` runs inside it; cancelling it stops the run.
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    # Set by the first request.
    requested: trio.Event = attrs.field(factory=trio.Event)
    # What asked first ("SIGTERM"), and what asked a second time.
    reason: str | None = None
    forced_by: str | None = None
    # Set by `run_daemon` once dispatching has begun: a stop then lets work in flight end.
    graceful: bool = False
    _deadline: float = math.inf
    _grace_scopes: list[trio.CancelScope] = attrs.field(factory=list)

    def request(self, reason: str) -> None:
        """Ask for a stop; the second call makes it immediate, later ones do nothing."""
        if self.reason is None:
            self.reason = reason
            self._deadline = trio.current_time() + self.grace_s
            phase = "running" if self.graceful else "start-up"
            log.info("stopping", signal=reason, during=phase, grace_s=self.grace_s)
            self.requested.set()
            if not self.graceful:
                self.scope.cancel()
        elif self.forced_by is None:
            self.forced_by = reason
            log.warning("second signal: stopping now", signal=reason)
            for scope in self._grace_scopes:
                scope.cancel()
            self.scope.cancel()

    def grace(self) -> trio.CancelScope:
        """A scope for one graceful part of the stop: it ends at the grace deadline (counted
        from the first request), or at once when a second request came or comes."""
        scope = trio.CancelScope(deadline=self._deadline)
        if self.forced_by is not None:
            scope.cancel()
        self._grace_scopes.append(scope)
        return scope

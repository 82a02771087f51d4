"""The running program: `run_daemon` and the services it starts in one trio nursery.

Start-up checks and sync, the dispatcher and its HTTP clients, the policy watcher and
the server pool, admission, shipping and sweeping, the progress file, the stall watch and
the progress line, metrics, and stopping on a signal.
This layer does the I/O; the decisions are `orchestrator.core`'s.

The names are imported when first used (PEP 562): a module of this layer imported on its
own (`check-config` reading the bearer token) does not import the whole daemon.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from orchestrator.lazy_names import lazy_names

if TYPE_CHECKING:
    from orchestrator.daemon.run import RunOutcome as RunOutcome
    from orchestrator.daemon.run import run_daemon as run_daemon
    from orchestrator.daemon.run_state import RunState as RunState
    from orchestrator.daemon.stop import Stop as Stop

_HOMES = {
    "RunOutcome": "orchestrator.daemon.run",
    "run_daemon": "orchestrator.daemon.run",
    "RunState": "orchestrator.daemon.run_state",
    "Stop": "orchestrator.daemon.stop",
}

__all__ = sorted(_HOMES)


__getattr__ = lazy_names(__name__, _HOMES)

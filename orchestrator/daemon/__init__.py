"""The running program: `run_daemon` and the services it starts in one trio nursery.

Start-up checks and sync, the dispatcher and its HTTP clients, the policy watcher and
the server pool, admission, shipping and sweeping, the progress file, the stall watch and
the progress line, metrics, and stopping on a signal.
This layer does the I/O; the decisions are `orchestrator.core`'s.
"""

from orchestrator.daemon.run import RunOutcome, run_daemon
from orchestrator.daemon.run_state import RunState
from orchestrator.daemon.stop import Stop

__all__ = ["RunOutcome", "RunState", "Stop", "run_daemon"]

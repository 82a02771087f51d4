"""The running program: `run_daemon` and the services it starts in one trio nursery.

Start-up checks and sync, the dispatcher and its HTTP clients, the policy watcher and
the server pool, shipping and discarding, the stall watch, and stopping on a signal.
This layer does the I/O; the decisions are `orchestrator.core`'s.
"""

from orchestrator.daemon.run import RunOutcome, run_daemon

__all__ = ["RunOutcome", "run_daemon"]

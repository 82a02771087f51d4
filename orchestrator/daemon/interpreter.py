"""The interpreter tuned for a long-running event loop, and put back afterwards."""

from __future__ import annotations

import gc
import sys

#: How long a worker thread may hold the interpreter lock before the event loop's thread
#: can take it (Python's default is 5 ms): the batch writer's planning and the file checks
#: run Python in worker threads, and the loop waited for them.
SWITCH_INTERVAL_S = 0.001


def tune_interpreter_for_the_loop() -> float:
    """Hide what start-up allocated (imported modules, the config, the services' and
    clients' structures: about 70,000 objects, all living as long as the daemon) from the
    cycle collector, so a full collection scans only what the run allocates: at real scale
    each full collection over them stopped the event loop for 30-35 ms
    (docs/benchmarks.md); and let worker threads hand the interpreter lock back to the
    loop sooner. Returns the previous switch interval, for `untune_interpreter`."""
    gc.collect()
    gc.freeze()
    previous = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    return previous


def untune_interpreter(switch_interval: float | None) -> None:
    """Undo `tune_interpreter_for_the_loop` (`switch_interval`: what it returned, None when
    it did not run)."""
    gc.unfreeze()
    if switch_interval is not None:
        sys.setswitchinterval(switch_interval)

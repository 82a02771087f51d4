"""A run as `orchestrator run` composes it: the simulator's fleet beside the daemon when
the config's `[sim]` section asks for one, the environment its `[env]` section names, and
the hand-off format of `[trainer] format`.

The daemon itself (`orchestrator.daemon.run_daemon`) knows nothing of the simulator: it is
given the servers' URLs and the environment. Tests and benchmarks that run a whole run
in-process call `launch_run` as the command does.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

import trio

from orchestrator.config import Config
from orchestrator.core.environments import Environment
from orchestrator.daemon import RunOutcome, RunState, Stop, run_daemon
from orchestrator.handoff import handoff_format
from orchestrator.sim.environments import toy_environment
from orchestrator.sim.fleet import serve_local_fleet


def environment_of(config: Config) -> Environment:
    """The environment `[env]` names (the simulator's toy environments, for now)."""
    env = config.env
    return toy_environment(
        env.name,
        prompt_len_min=env.prompt_len_min,
        prompt_len_max=env.prompt_len_max,
        vocab_size=config.sim.vocab_size,
        max_turns=env.max_turns,
        seed=config.seed,
    )


async def launch_run(
    config: Config,
    *,
    stop: Stop | None = None,
    metrics_sockets: Sequence[socket.socket] = (),
    task_status: trio.TaskStatus[RunState] = trio.TASK_STATUS_IGNORED,
) -> RunOutcome:
    """Start the local fleet `config` asks for (if any), run the daemon against it and the
    `[inference] urls`, stop the fleet when the daemon returns. Raises what `run_daemon`
    raises, unwrapped from this function's own nursery."""
    try:
        async with trio.open_nursery() as nursery:
            fleet: list[str] = await nursery.start(serve_local_fleet, config)
            outcome = await run_daemon(
                config,
                servers=[*config.inference.urls, *fleet],
                environment=environment_of(config),
                handoff=handoff_format(config.trainer.format),
                stop=stop,
                metrics_sockets=metrics_sockets,
                task_status=task_status,
            )
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The daemon's error (the fleet only ends by being cancelled): raised as the daemon
        # raised it, not inside this nursery's group.
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise
    return outcome

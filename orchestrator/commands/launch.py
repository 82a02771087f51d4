"""A run as `orchestrator run` composes it: the simulator's fleet beside the daemon when
the config's `[sim]` section asks for one, the environment (the real tasks of its
`[[env]]`s, or the simulator's toy environment when it lists none), and the hand-off
format of `[trainer] format`.

The daemon itself (`orchestrator.daemon.run_daemon`) knows nothing of the simulator: it is
given the servers' URLs and the environment. Tests and benchmarks that run a whole run
in-process call `launch_run` as the command does.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import trio

from orchestrator.config import Config
from orchestrator.core.environments import Environment
from orchestrator.daemon import RunOutcome, RunState, Stop, run_daemon
from orchestrator.daemon.inference.credentials import load_bearer_token
from orchestrator.sim.environments import toy_environment
from orchestrator.sim.fleet import serve_local_fleet
from orchestrator.tasks.build import Tasks, open_tasks


def toy_environment_of(config: Config) -> Environment:
    """The simulator's toy environment `[sim] env` names (a run that lists no [[env]])."""
    sim = config.sim
    return toy_environment(
        sim.env,
        prompt_len_min=sim.prompt_len_min,
        prompt_len_max=sim.prompt_len_max,
        vocab_size=sim.tokens()[0],
        max_turns=sim.max_turns,
        max_tokens=sim.max_tokens,
        seed=config.seed,
    )


@asynccontextmanager
async def open_environment(config: Config) -> AsyncIterator[Tasks]:
    """The run's environment (its `[[env]]`s' real tasks, or the toy one) and its eval
    tasks (`[[eval.env]]`)."""
    if not config.env and not config.eval.env:
        yield Tasks(toy_environment_of(config))
        return
    async with open_tasks(config) as tasks:
        environment = tasks.environment or toy_environment_of(config)
        yield Tasks(environment, tasks.evals, tasks.model_tokens)


async def launch_run(
    config: Config,
    *,
    stop: Stop | None = None,
    metrics_sockets: Sequence[socket.socket] = (),
    task_status: trio.TaskStatus[RunState] = trio.TASK_STATUS_IGNORED,
) -> RunOutcome:
    """Read the servers' bearer token, open the run's environment and eval tasks (their
    reward workers start as they open, `open_tasks`), start the local fleet `config` asks
    for (if any), run the daemon against it and the `[inference] urls`, stop the fleet
    when the daemon returns. Raises `UserError` for a token or tasks that do not load
    (before anything starts), and what `run_daemon` raises, unwrapped from this
    function's own nursery."""
    token = await trio.to_thread.run_sync(load_bearer_token, config.inference)
    try:
        async with open_environment(config) as tasks, trio.open_nursery() as nursery:
            fleet: list[str] = await nursery.start(serve_local_fleet, config, tasks.model_tokens)
            assert tasks.environment is not None
            outcome = await run_daemon(
                config,
                servers=[*config.inference.urls, *fleet],
                environment=tasks.environment,
                evals=tasks.evals,
                handoff=config.handoff,
                token=token,
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

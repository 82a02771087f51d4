"""Rollouts whose environment drives its own turns (a verifiers environment,
`core.environments.DrivenEpisode`; docs/design.md § Environments that drive their own
turns): the environment calls the model at the daemon's endpoint (`inference/model_endpoint.py`)
for this rollout, and each call is run here as the rollout's next turn, by the runner's
own turn (`take_turn`: the request built, sent, retried and checked as for any turn).
Once the episode ends, what the environment recorded must be what was sampled.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Awaitable, Callable, Mapping

import attrs
import numpy as np
import trio

from orchestrator.core.environments import Driven, DrivenEpisode, Sampling
from orchestrator.core.turns import TurnOutput
from orchestrator.daemon.inference.model_endpoint import CallRefused, GenerateCall, ModelDesk
from orchestrator.daemon.rejections import Rejections
from orchestrator.daemon.rollout_run import RolloutRun
from orchestrator.wire import InferenceFailure

#: One turn of a rollout: (run, turn index, sampling, routing start, stop) -> its output;
#: raises `InferenceFailure` once retries are spent.
TakeTurn = Callable[[RolloutRun, int, Sampling, int, trio.Event], Awaitable[TurnOutput]]


@attrs.frozen
class DrivenRollouts:
    """Runs driven rollouts through `desk`, their turns by `take_turn`, recording what
    goes wrong in `rejections`."""

    desk: ModelDesk
    rejections: Rejections
    take_turn: TakeTurn

    async def run(
        self, run: RolloutRun, sampling: Sampling, episode: DrivenEpisode, stop: trio.Event
    ) -> RolloutRun:
        """A rollout whose environment drives its turns: each of its calls to the model
        endpoint is run here as a turn (`_turn`); once it ends, what it recorded
        must be what was sampled (docs/design.md § Environments that drive their turns)."""
        run_turn = functools.partial(self._turn, run, sampling, stop)
        async with (
            self.desk.rollout(run_turn) as (model_url, calls),
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(calls.serve)
            driven = await episode.drive(model_url)
            nursery.cancel_scope.cancel()
        for status, message in driven.failed_calls:
            # Calls the environment saw fail that never reached the endpoint (or were
            # answered 5xx): in the run's failures, not only in the worker's log.
            detail = f"a model call of the environment failed: HTTP {status}: {message}"
            self.rejections.record("model_call", run.server, detail, rollout=run.rollout_id)
        if run.failed is not None:
            return run
        problem = driven.error or _disagreement(driven, run)
        if problem is not None:
            kind = "environment" if driven.error else "trajectory_mismatch"
            self.rejections.record(kind, run.server, problem, rollout=run.rollout_id)
            return run.fail(kind, problem)
        run.metrics = _finite(driven.metrics)
        return run

    async def _turn(
        self, run: RolloutRun, sampling: Sampling, stop: trio.Event, call: GenerateCall
    ) -> TurnOutput:
        """One call of a driven rollout, run as its next turn; raises `CallRefused` for a
        call it will not run (the rollout fails with the first reason)."""
        turn_index = len(run.turns)
        if run.failed is not None:
            raise CallRefused(410, f"the rollout has failed already: {run.failed}")
        if stop.is_set():
            run.fail("stopped", "stopped: the group can no longer ship")
            raise CallRefused(410, "stopped: the group can no longer ship")
        if turn_index >= sampling.max_turns:
            raise CallRefused(
                400, f"the rollout has had its {sampling.max_turns} turns (max_turns)"
            )
        held = len(run.tokens)
        if turn_index and not (
            len(call.token_ids) > held and np.array_equal(call.token_ids[:held], run.tokens)
        ):
            detail = (
                f"turn {turn_index}'s tokens do not extend the last turn's prompt and completion"
                " (the conversation was rendered anew, not bridged)"
            )
            self.rejections.record(
                "trajectory_mismatch", run.server, detail, rollout=run.rollout_id
            )
            run.fail("trajectory_mismatch", detail)
            raise CallRefused(400, detail)
        asked = sampling.max_tokens if call.max_tokens is None else call.max_tokens
        stops = tuple(dict.fromkeys((*sampling.stop_token_ids, *call.stop_token_ids)))
        turn_sampling = attrs.evolve(
            sampling, max_tokens=min(asked, sampling.max_tokens), stop_token_ids=stops
        )
        # Routing rows from where the rows held end: the last sampled token was never run
        # forward (as in `run`).
        routing_start = held - 1 if turn_index else 0
        run.tokens = call.token_ids
        try:
            turn = await self.take_turn(run, turn_index, turn_sampling, routing_start, stop)
        except InferenceFailure as failure:
            run.fail(failure.kind, str(failure))
            raise CallRefused(410, f"the inference server failed: {failure}") from None
        run.turns.append((len(run.tokens), turn))
        run.tokens = np.concatenate([run.tokens, turn.completion_ids])
        return turn


def _finite(metrics: Mapping[str, object]) -> dict[str, float]:
    """The metrics that are finite numbers (the environment is user code)."""
    return {
        str(name): float(value)
        for name, value in metrics.items()
        if isinstance(value, int | float) and math.isfinite(value)
    }


def _disagreement(driven: Driven, run: RolloutRun) -> str | None:
    """Why the environment's record of the turns is not what the daemon sampled (None:
    it is): the sample is built from the daemon's turns, never from the environment's."""
    sampled = [tuple(turn.completion_ids.tolist()) for _, turn in run.turns]
    recorded = [tuple(completion) for completion in driven.completions]
    if not sampled:
        return "the environment never called the model"
    if recorded != sampled:
        return (
            f"the environment recorded {len(recorded)} completions that differ from the "
            f"{len(sampled)} turns the daemon sampled"
        )
    return None

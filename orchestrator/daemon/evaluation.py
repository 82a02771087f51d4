"""The evaluator: evals beside training, at the versions `[eval]` names (docs/design.md
§ Evals).

Each eval runs every `EvalTask`'s prompts `rollouts_per_example` times on the run's
servers, under whatever version they hold, without payload capture (no `payload_dir`,
no routing start: no files, no payload memory), and scores them with the task's rewards
(in the reward workers, like training's). Eval rollouts take at most
`inflight_share` of the in-flight limit while training runs, and the dispatcher counts
them against it, so a batch is never delayed by more than that share of the fleet; once
training is over (the last version is being evaluated) they may take all of it.

A failed eval rollout (a request, the environment, a reward) is counted and reported in
the eval's line, never the end of the run. Each eval ends in one `eval` log line per env,
one line of `<run_dir>/evals.jsonl`, and the Prometheus families of `metrics/`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
import structlog
import trio

from orchestrator.config import Config
from orchestrator.core.environments import Prompt, PromptSkipped, ScoreFailed
from orchestrator.core.evals import (
    EnvEvalResult,
    EvalReport,
    EvalSample,
    EvalSchedule,
    EvalTask,
    eval_capacity,
    summarize,
)
from orchestrator.daemon.inference.http11 import HTTP11Client
from orchestrator.daemon.inference.model_endpoint import ModelDesk
from orchestrator.daemon.inference.server_pool import ServerPool
from orchestrator.daemon.reporting.run_lines import RunLines
from orchestrator.daemon.rollout_finisher import score
from orchestrator.daemon.rollout_runner import RolloutRunner
from orchestrator.daemon.run_state import RunState

log = structlog.get_logger(__name__)


@attrs.define(eq=False)
class Evaluator:
    """Runs the evals the schedule names; see `serve`."""

    config: Config
    state: RunState
    tasks: Sequence[EvalTask]
    client: HTTP11Client
    pool: ServerPool
    lines: RunLines
    resumed: bool = False
    # Where environments that drive their own turns call the model.
    desk: ModelDesk | None = None
    _schedule: EvalSchedule = attrs.field(init=False)
    _runner: RolloutRunner = attrs.field(init=False)
    # Eval rollouts are never asked to stop early: they end with their requests.
    _never: trio.Event = attrs.field(factory=trio.Event, init=False)

    def __attrs_post_init__(self) -> None:
        config, evals = self.config, self.config.eval
        self._schedule = EvalSchedule(
            interval=evals.interval,
            eval_base_model=evals.eval_base_model,
            skip_eval_on_resume=evals.skip_eval_on_resume,
            max_steps=config.max_steps,
        )
        self._runner = RolloutRunner(
            config,
            self.state,
            self.client,
            self.pool,
            self.state.evaluation.rejections,
            capture=False,
            desk=self.desk,
        )

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Evaluate each applied version the schedule names, one eval at a time, until
        cancelled. A version applied while an eval runs is looked at once it ends."""
        state, evaluation = self.state, self.state.evaluation
        task_status.started()
        while True:
            version, previous = state.versions.applied, evaluation.looked_at
            if previous is None:
                due = self._schedule.first_due(version, resumed=self.resumed)
            else:
                due = self._schedule.due(previous, version)
            if due:
                evaluation.running = version
            evaluation.looked_at = version
            state.notify()
            if due:
                await self.evaluate(version, resumed=self.resumed and previous is None)
            while state.versions.applied == evaluation.looked_at:
                await state.wait_changed()

    async def wait_caught_up(self, version: int) -> None:
        """Until every eval due at versions up to `version` has ended (the run's end)."""
        evaluation = self.state.evaluation
        while not (
            evaluation.looked_at is not None
            and evaluation.looked_at >= version
            and evaluation.running is None
        ):
            await self.state.wait_changed()

    async def evaluate(self, version: int, *, resumed: bool = False) -> EvalReport:
        """One eval of every task, started under `version`: logged, appended to
        `evals.jsonl`, kept as the last eval."""
        state, evaluation = self.state, self.state.evaluation
        evaluation.running = version
        started_at, started = time.time(), trio.current_time()
        step = state.shipping.last_shipped
        log.info("eval started", version=version, envs=[task.name for task in self.tasks])
        results: list[EnvEvalResult | None] = [None] * len(self.tasks)

        async def run_task(index: int, task: EvalTask) -> None:
            results[index] = await self._evaluate_task(task, version)

        try:
            async with trio.open_nursery() as nursery:
                for index, task in enumerate(self.tasks):
                    nursery.start_soon(run_task, index, task)
            report = EvalReport(
                version=version,
                step=step,
                started_at=started_at,
                duration_s=trio.current_time() - started,
                results=tuple(result for result in results if result is not None),
                resumed=resumed,
            )
            evaluation.evals += 1
            evaluation.last = report
            self._log(report)
            await self.lines.eval(report.to_json())
        finally:
            # Only now: the run's end waits for this, and its line must be written by then.
            evaluation.running = None
            state.notify()
        return report

    def _log(self, report: EvalReport) -> None:
        for result in report.results:
            log.info(
                "eval",
                version=report.version,
                env=result.env,
                reward_mean=_round(result.reward_mean),
                pass_at=None
                if result.pass_at is None
                else {f"pass@{k}": round(v, 4) for k, v in result.pass_at.items()},
                samples=result.samples,
                failed=result.failed,
                completion_tokens_mean=_round(result.completion_tokens_mean),
                versions=list(result.versions),
                duration_s=round(report.duration_s, 3),
            )

    async def _evaluate_task(self, task: EvalTask, version: int) -> EnvEvalResult:
        per_example = self.config.eval.rollouts_per_example
        samples: list[EvalSample] = []
        skipped = 0
        async with trio.open_nursery() as nursery:
            for example in range(task.examples):
                try:
                    prompt = await task.environment.prompt(example)
                except PromptSkipped:
                    skipped += 1
                    continue
                except Exception as exc:  # an env that cannot start: this eval goes on
                    log.warning("eval prompt failed", env=task.name, error=repr(exc)[:300])
                    skipped += 1
                    continue
                for member in range(per_example):
                    server = await self._take_slot()
                    rollout_id = f"eval-v{version}-{task.name}-p{example:05d}-r{member}"
                    nursery.start_soon(
                        self._run_one, task, prompt, example, rollout_id, server, samples
                    )
        if skipped:
            log.warning("eval prompts skipped", env=task.name, skipped=skipped, version=version)
        return summarize(
            task.name, samples, rollouts_per_example=per_example, skipped_prompts=skipped
        )

    async def _take_slot(self) -> str:
        """Wait for room within the eval share and a healthy server; take both."""
        state, evaluation = self.state, self.state.evaluation
        while True:
            capacity = self._capacity()
            server = self.pool.pick() if evaluation.inflight < capacity else None
            if server is not None:
                break
            await state.wait_changed()
        evaluation.inflight += 1
        if not state.training_over:
            evaluation.peak_inflight = max(evaluation.peak_inflight, evaluation.inflight)
        self.pool.pin(server, 1)
        return server

    def _capacity(self) -> int:
        state = self.state
        return eval_capacity(
            self.config.eval.inflight_share,
            state.limits.in_force(self.config.inference.max_inflight),
            training_over=state.training_over,
        )

    async def _run_one(
        self,
        task: EvalTask,
        prompt: Prompt,
        example: int,
        rollout_id: str,
        server: str,
        samples: list[EvalSample],
    ) -> None:
        state, evaluation = self.state, self.state.evaluation
        try:
            episode = task.environment.episode(prompt)
            run = await self._runner.run(rollout_id, prompt, episode, server, self._never)
        finally:
            evaluation.inflight -= 1
            self.pool.unpin(server, 1)
            state.notify()
        completion_tokens = sum(len(turn.completion_ids) for _, turn in run.turns)
        if run.failed is not None:
            evaluation.rollouts["failed"] += 1
            kind = run.failure_kind or "failed"
            samples.append(EvalSample(example, run.version, failed=kind))
            return
        try:
            reward = await score(run)
        except ScoreFailed as exc:
            # Logged by the environment (once per env and kind, with its traceback).
            evaluation.rollouts["failed"] += 1
            evaluation.failures["reward_failed"] += 1
            samples.append(EvalSample(example, run.version, failed="reward_failed"))
            log.debug("eval reward failed", rollout=rollout_id, kind=exc.kind)
            return
        evaluation.rollouts["scored"] += 1
        samples.append(
            EvalSample(example, run.version, reward, completion_tokens, metrics=run.metrics)
        )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)

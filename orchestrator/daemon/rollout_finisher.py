"""What becomes of a rollout once its turns are over, before its group is handed on: its
payload files checked on disk, its episode scored, its sample built, and every problem
recorded as a rejection. The dispatcher (`orchestrator.daemon.dispatcher`) keeps only
dispatch and hands each group here; the evaluator scores its rollouts through the same
`score`.

A problem costs the rollout, never the group or the run: a bad file makes the rollout
untrainable (its sample is kept, marked poisoned), a reward that fails or a sample the
stitcher cannot build fails the rollout (its files go with it, docs/design.md §6).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio
from payload_gc import PayloadGCError, PayloadRootFiles

from orchestrator.config import Config
from orchestrator.core.environments import ScoreFailed
from orchestrator.core.rollouts import Discard, RolloutResult
from orchestrator.core.samples import build_sample
from orchestrator.daemon.inference.client import TurnFiles, check_turn_files
from orchestrator.daemon.pass_budget import yield_if_pass_is_long
from orchestrator.daemon.rollout_run import RolloutRun
from orchestrator.daemon.run_state import RunState


async def score(run: RolloutRun) -> float:
    """The reward of what the model said in `run`, from its own episode (the members of a
    group diverge). Raises `ScoreFailed`, which the environment has logged."""
    assert run.episode is not None  # every rollout that ran has its episode
    return await run.episode.score([turn.completion_ids for _, turn in run.turns])


@attrs.define
class RolloutFinisher:
    """Turns training's finished rollouts into results: see the module docstring."""

    config: Config
    state: RunState
    file_limiter: trio.CapacityLimiter

    async def finish_group(
        self,
        group_id: str,
        start_version: int,
        runs: Sequence[RolloutRun | None],
        *,
        check_files: bool,
    ) -> tuple[RolloutResult, ...]:
        """Every member's result, in member order: its files checked first (when
        `check_files`), then scored concurrently (a reward may run in a worker process or
        on another machine). A member that never ran (`None`) was cancelled."""
        if check_files:
            await self.check_files([run for run in runs if run is not None])
        finished: list[RolloutResult | None] = [None] * len(runs)

        async def finish(index: int, run: RolloutRun) -> None:
            finished[index] = await self.finish(run)

        async with trio.open_nursery() as nursery:
            for index, run in enumerate(runs):
                if run is None:
                    finished[index] = RolloutResult(
                        f"{group_id}-r{index}", start_version, failed="cancelled"
                    )
                else:
                    nursery.start_soon(finish, index, run)
        return tuple(result for result in finished if result is not None)

    async def check_files(self, runs: Sequence[RolloutRun]) -> None:
        """Check every segment file of the group on disk, in one worker-thread call.

        Once per group rather than per turn: a bad file only makes a rollout untrainable
        (the episode's tokens stay good), so the check can wait until the group is done.
        """
        checks = [
            (run, index, turn)
            for run in runs
            if run.payload_dir is not None
            for index, (_, turn) in enumerate(run.turns)
            if turn.files
        ]
        if not checks:
            return
        root = self.config.payload_root

        def check_all() -> list[TurnFiles]:
            try:
                opened = PayloadRootFiles(root)
            except PayloadGCError as exc:
                return [TurnFiles(f"payload root: {exc}", {}) for _ in checks]
            with opened:
                return [check_turn_files(t, files=opened, version=r.version) for r, _, t in checks]

        found = await trio.to_thread.run_sync(check_all, limiter=self.file_limiter)
        # What servers wrote, counted as found on disk (never the sizes replies claim):
        # also the daemon's running account of the bytes on disk (docs/design.md §8).
        sizes = {
            (run.version, name): size
            for (run, _, _), turn_files in zip(checks, found, strict=True)
            for name, size in turn_files.sizes.items()
        }
        state = self.state
        state.payload.record_written(sizes, collected_below=state.versions.collected_below)
        bound = state.collecting_below
        for (run, index, turn), turn_files in zip(checks, found, strict=True):
            problem = turn_files.problem
            # A version collected while the check ran: the rollout is stale, not poisoned.
            if problem is not None and run.version >= bound:
                state.dispatch.rejections.record(
                    "poisoned_payload", run.server, problem, rollout=run.rollout_id
                )
                prompt_len = run.turns[index][0]
                run.turns[index] = (prompt_len, attrs.evolve(turn, poisoned=problem))

    async def finish(self, run: RolloutRun) -> RolloutResult:
        """Score a finished rollout and build its sample."""
        dispatch = self.state.dispatch
        files = frozenset(f for _, turn in run.turns for f in turn.files)
        if run.failed is not None:
            stopped = run.failure_kind == "stopped"
            dispatch.rollouts["stopped" if stopped else "failed"] += 1
            return RolloutResult(run.rollout_id, run.version, files=files, failed=run.failed)
        try:
            reward = await score(run)
        except ScoreFailed as exc:
            dispatch.rollouts["reward_failed"] += 1
            return RolloutResult(
                run.rollout_id,
                run.version,
                files=files,
                failed=f"reward failed: {exc}",
                failure=Discard.REWARD_FAILED,
            )
        await yield_if_pass_is_long()
        try:
            sample, routing_dropped = build_sample(
                run.rollout_id,
                run.tokens,
                run.turns,
                payload_dir=run.payload_dir,
                fields=self.config.payload.fields,
                final_token_route=self.config.payload.final_token_route,
            )
        except Exception as exc:  # no reply may end the daemon
            # Replies that passed every check but break the stitcher in a way nobody
            # foresaw: this rollout is lost (its files go with it), the daemon runs on.
            detail = f"cannot build the sample ({exc!r:.200})"
            dispatch.rejections.record("stitching", run.server, detail, rollout=run.rollout_id)
            dispatch.rollouts["failed"] += 1
            return RolloutResult(run.rollout_id, run.version, files=files, failed=detail)
        if routing_dropped:
            dispatch.rejections.record(
                "routing_gap",
                run.server,
                "routing has a gap the stitcher cannot close: sample kept without routing",
                rollout=run.rollout_id,
            )
        poisoned = sample.untrainable is not None and sample.untrainable.startswith("poisoned")
        if poisoned and not any(turn.poisoned for _, turn in run.turns):
            # Every turn's payload was good on its own, but they cannot be stitched into
            # one sample (turns that disagree on row shape). A poisoned turn was
            # recorded as "poisoned_payload" already.
            dispatch.rejections.record(
                "stitching", run.server, str(sample.untrainable), rollout=run.rollout_id
            )
        dispatch.rollouts["poisoned" if poisoned else "completed"] += 1
        return RolloutResult(
            run.rollout_id,
            run.version,
            reward=reward,
            samples=(sample,),
            files=files,
            metrics=run.metrics,
        )

"""What becomes of a rollout once its turns are over, before its group is handed on: its
episode scored, its payload files checked on disk, its sample built, and every problem
recorded as a rejection. A group the sink will discard on its rewards alone (no signal,
or outside the curriculum) gets neither the read of its files nor its samples: it could
not ship whatever they held. The dispatcher (`orchestrator.daemon.dispatcher`) keeps only
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
from orchestrator.core.sink import SinkLimits, discarded_by_rewards
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
    limits: SinkLimits  # the sink's: which groups it discards on their rewards alone
    file_limiter: trio.CapacityLimiter

    async def finish_group(
        self,
        group_id: str,
        start_version: int,
        runs: Sequence[RolloutRun | None],
        *,
        check_files: bool,
    ) -> tuple[RolloutResult, ...]:
        """Every member's result, in member order. The members are scored first,
        concurrently (a reward may run in a worker process or on another machine). A
        group the sink discards on its rewards alone (`discarded_by_rewards`: all equal,
        or a mean outside the curriculum) ships nothing whatever its samples would hold:
        its files are only looked at for their sizes (`check_files`, not read), and its
        results carry rewards and files but no sample. Any other group has its files
        checked (when `check_files`) and then each member's sample built. A member that
        never ran (`None`) was cancelled."""
        scored: list[float | RolloutResult] = [0.0] * len(runs)

        async def score_member(index: int, run: RolloutRun) -> None:
            scored[index] = await self._score(run)

        async with trio.open_nursery() as nursery:
            for index, run in enumerate(runs):
                if run is None:
                    scored[index] = RolloutResult(
                        f"{group_id}-r{index}", start_version, failed="cancelled"
                    )
                else:
                    nursery.start_soon(score_member, index, run)
        rewards = [reward for reward in scored if not isinstance(reward, RolloutResult)]
        ships = bool(rewards) and discarded_by_rewards(rewards, self.limits) is None
        if check_files:
            await self.check_files([run for run in runs if run is not None], read=ships)
        results: list[RolloutResult] = []
        for run, reward in zip(runs, scored, strict=True):
            if isinstance(reward, RolloutResult):
                results.append(reward)
                continue
            assert run is not None  # a member that never ran has its result already
            if ships:
                await yield_if_pass_is_long()
                results.append(self._built(run, reward))
            else:
                results.append(self._unbuilt(run, reward))
        return tuple(results)

    async def check_files(self, runs: Sequence[RolloutRun], *, read: bool = True) -> None:
        """Check every segment file of the group on disk, in one worker-thread call; with
        `read` false, only each file's size (what the run's account of the disk needs),
        none of its bytes (`check_turn_files`).

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
                return [
                    check_turn_files(t, files=opened, version=r.version, read=read)
                    for r, _, t in checks
                ]

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

    async def _score(self, run: RolloutRun) -> float | RolloutResult:
        """The reward of a finished rollout, or its result when it failed (its request,
        or its reward)."""
        dispatch = self.state.dispatch
        if run.failed is not None:
            stopped = run.failure_kind == "stopped"
            dispatch.rollouts["stopped" if stopped else "failed"] += 1
            return RolloutResult(run.rollout_id, run.version, files=_files(run), failed=run.failed)
        try:
            return await score(run)
        except ScoreFailed as exc:
            dispatch.rollouts["reward_failed"] += 1
            dispatch.reward_errors.note(exc.kind, exc.detail)
            return RolloutResult(
                run.rollout_id,
                run.version,
                files=_files(run),
                failed=f"reward failed: {exc}",
                failure=Discard.REWARD_FAILED,
            )

    def _unbuilt(self, run: RolloutRun, reward: float) -> RolloutResult:
        """A scored rollout's result without a sample (its group ships nothing)."""
        # Poisoned as far as the reply and the sizes on disk tell.
        poisoned = any(turn.poisoned for _, turn in run.turns)
        self.state.dispatch.rollouts["poisoned" if poisoned else "completed"] += 1
        return RolloutResult(
            run.rollout_id, run.version, reward=reward, files=_files(run), metrics=run.metrics
        )

    def _built(self, run: RolloutRun, reward: float) -> RolloutResult:
        """A scored rollout's result, with its sample built."""
        dispatch = self.state.dispatch
        files = _files(run)
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


def _files(run: RolloutRun) -> frozenset[str]:
    """Every payload file the rollout's turns wrote."""
    return frozenset(f for _, turn in run.turns for f in turn.files)

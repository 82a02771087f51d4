"""The dispatcher: starts GRPO groups, runs their rollouts (`rollout_runner.py`), has
them finished (scored, files checked, samples built: `rollout_finisher.py`) and hands the
group on to the sink.

Each group is `group_size` rollouts of one prompt, pinned to one inference server. Every
rollout is stamped with the applied version `k` at its dispatch and writes its payload
files into `<root>/v<k>/` (docs/design.md §3). A group runs in its own cancel scope, so the policy
watcher can cancel groups that can no longer ship (their files are left to the version
collector and to the sink's stale accounting).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs
import structlog
import trio
import trio.lowlevel

from orchestrator.config import Config
from orchestrator.core.dispatch_gate import DispatchGate, Pipe
from orchestrator.core.environments import Environment, Prompt, PromptSkipped
from orchestrator.core.refusals import RefusalWatch
from orchestrator.core.rollouts import GroupResult
from orchestrator.core.sink import TrainSink
from orchestrator.daemon.inference.http11 import HTTP11Client
from orchestrator.daemon.inference.model_endpoint import ModelDesk
from orchestrator.daemon.inference.server_pool import ServerPool
from orchestrator.daemon.rollout_finisher import RolloutFinisher
from orchestrator.daemon.rollout_run import RolloutRun
from orchestrator.daemon.rollout_runner import RolloutRunner
from orchestrator.daemon.run_state import InflightGroup, RunState

log = structlog.get_logger(__name__)


@attrs.frozen
class Dispatched:
    """When a group was dispatched: trio's clock, and the batch being filled then."""

    at: float
    step: int


@attrs.define
class Dispatcher:
    """Starts groups while the gate is open and runs them; see `serve`."""

    config: Config
    state: RunState
    environment: Environment
    client: HTTP11Client
    # Hands a finished group to the sink (`Admission.admit`); the group counts as in flight
    # until it returns, so the gate always sees it in one place or the other.
    admit: Callable[[GroupResult], Awaitable[None]]
    sink: TrainSink  # read for its count of queued samples
    file_limiter: trio.CapacityLimiter
    pool: ServerPool
    # Where environments that drive their own turns call the model.
    desk: ModelDesk | None = None
    _gate: DispatchGate = attrs.field(init=False)
    _runner: RolloutRunner = attrs.field(init=False)
    _finisher: RolloutFinisher = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        config, state = self.config, self.state
        self._gate = DispatchGate(config.staleness, config.batch.size, config.batch.group_size)
        self._runner = RolloutRunner(
            config,
            state,
            self.client,
            self.pool,
            state.dispatch.rejections,
            capture=True,
            refusals=RefusalWatch(config.inference.refusal_stop_s),
            desk=self.desk,
        )
        self._finisher = RolloutFinisher(config, state, self.sink.limits, self.file_limiter)

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start groups until cancelled, drawing the environment's prompts from
        `state.dispatch.prompts_drawn` on."""
        dispatch = self.state.dispatch
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                # Drawn before the gate opens, so that tokenizing it never delays a group.
                prompt = await self._next_prompt()
                while not self._may_start():
                    await self.state.wait_changed()
                server = self.pool.pick()
                while server is None:
                    # Every server is down: wait for the prober to bring one back.
                    await self.state.wait_changed()
                    server = self.pool.pick()
                dispatch.prompts_drawn += 1
                group_id = f"g{dispatch.prompts_drawn:07d}-{prompt.prompt_id}"
                # Counted here, not in the task, so the gate sees it before the next pass.
                dispatch.inflight_rollouts += self.config.batch.group_size
                self.pool.pin(server, self.config.batch.group_size)
                nursery.start_soon(
                    self._run_group,
                    group_id,
                    prompt,
                    server,
                    Dispatched(trio.current_time(), self.state.shipping.filling_step),
                )
                await trio.lowlevel.checkpoint()

    async def _next_prompt(self) -> Prompt:
        """The environment's prompt at `prompts_drawn` (counted once dispatched); an index
        it skips is counted by environment and passed over."""
        dispatch = self.state.dispatch
        while True:
            try:
                return await self.environment.prompt(dispatch.prompts_drawn)
            except PromptSkipped as skipped:
                dispatch.prompts_drawn += 1
                if not dispatch.prompts_skipped[skipped.env]:
                    log.warning(
                        "prompt skipped",
                        env=skipped.env,
                        reason=skipped.reason,
                        note="once per env",
                    )
                dispatch.prompts_skipped[skipped.env] += 1

    def _may_start(self) -> bool:
        state = self.state
        shipping = state.shipping
        pipe = Pipe(
            applied_version=state.versions.applied,
            next_step=shipping.filling_step,
            # Eval rollouts take their share of the limit (docs/design.md § Evals).
            inflight_rollouts=state.dispatch.inflight_rollouts + state.evaluation.inflight,
            queued_samples=self.sink.queued_samples,
            limit=state.limits.in_force(self.config.inference.max_inflight),
            min_allowance=state.limits.min_allowance,
            ending=state.training_over,
            batches_left=shipping.batches_left,
        )
        return self._gate.may_start(pipe)

    async def _run_group(
        self,
        group_id: str,
        prompt: Prompt,
        server: str,
        dispatched: Dispatched,
    ) -> None:
        state = self.state
        try:
            await self._run_and_hand_on(group_id, prompt, server, dispatched)
        finally:
            # Counted until the sink has the group, not only while its requests run: a
            # group waiting for its file check or its scores (behind a busy loop) is still
            # work the in-flight limit must see, or more is dispatched meanwhile; `admit`
            # has put it in the sink by now (docs/design.md §3, every group counted).
            state.dispatch.inflight_rollouts -= self.config.batch.group_size
            state.notify()

    async def _run_and_hand_on(
        self,
        group_id: str,
        prompt: Prompt,
        server: str,
        dispatched: Dispatched,
    ) -> None:
        state, size = self.state, self.config.batch.group_size
        dispatch = state.dispatch
        start_version = state.versions.applied
        runs: list[RolloutRun | None] = [None] * size
        scope = trio.CancelScope()
        group = InflightGroup(group_id, start_version, server, scope)
        dispatch.groups[group_id] = group
        try:
            with scope:
                episodes = [self.environment.episode(prompt) for _ in range(size)]
                await self._runner.run_group(runs, group_id, prompt, episodes, server, group.stop)
        finally:
            del dispatch.groups[group_id]
            self.pool.unpin(server, size)
            state.notify()
        if dispatch.stopping:
            # The run is over: nothing this group made can ship. Its files lie in versions
            # that the final collection (or the next run's start-up sync) deals with.
            dispatch.rollouts["stopped"] += size
            return
        if scope.cancelled_caught:
            log.info("group cancelled", group=group_id, start_version=start_version)
        # A stopped group can no longer ship (the sink drops it as stale), and its version
        # directory may already be collected: checking its files would only report them
        # missing.
        rollouts = await self._finisher.finish_group(
            group_id,
            start_version,
            runs,
            check_files=not (scope.cancelled_caught or group.stop.is_set()),
        )
        await self.admit(
            GroupResult(
                group_id,
                start_version,
                rollouts,
                server=server,
                env=prompt.env,
                temperature=prompt.sampling.temperature,
                dispatched_at=dispatched.at,
                dispatched_step=dispatched.step,
            )
        )

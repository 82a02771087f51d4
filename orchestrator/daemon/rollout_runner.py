"""One rollout, turn by turn: its generate requests (retried on transient failures), its
environment's replies between turns, until the episode ends or fails.

Training rollouts capture payloads (each request names its version's payload directory
and where its routing rows start, docs/design.md §3, §4); eval rollouts
(`orchestrator.daemon.evaluation`) run the same turns without: no `payload_dir`, no
routing start, and their replies' payload arrays are not read.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Mapping
from pathlib import Path

import attrs
import numpy as np
import structlog
import trio

from orchestrator.config import Config
from orchestrator.core.arrays import TOKEN_DTYPE
from orchestrator.core.environments import Driven, DrivenEpisode, Episode, Prompt, Sampling
from orchestrator.core.refusals import NO_ANSWER_KINDS, REFUSAL_KINDS, RefusalWatch
from orchestrator.core.turns import TurnOutput
from orchestrator.daemon.inference.client import encode_generate_request, post_generate
from orchestrator.daemon.inference.http11 import HTTP11Client
from orchestrator.daemon.inference.model_endpoint import CallRefused, GenerateCall, ModelDesk
from orchestrator.daemon.inference.server_pool import ServerPool
from orchestrator.daemon.pass_budget import yield_if_pass_is_long
from orchestrator.daemon.rejections import Rejections
from orchestrator.daemon.run_state import RunState
from orchestrator.payload import RoutingShape, version_dir
from orchestrator.wire import InferenceFailure, build_generate_request, parse_generate_response

log = structlog.get_logger(__name__)


@attrs.define
class RolloutRun:
    """A rollout while it runs: its turns so far, or why it failed (`failed`, and the
    failure's kind in `failure_kind`)."""

    rollout_id: str
    version: int
    payload_dir: Path | None
    tokens: np.ndarray  # int32: the prompt, then each turn's completion and env reply
    turns: list[tuple[int, TurnOutput]] = attrs.field(factory=list)
    failed: str | None = None
    failure_kind: str | None = None
    server: str = ""  # the inference server it ran on
    # Its conversation with the environment (the members of a group diverge).
    episode: Episode | DrivenEpisode | None = None
    # What an environment that drives its turns measured besides the reward.
    metrics: Mapping[str, float] = attrs.field(factory=dict)

    def fail(self, kind: str, detail: str) -> RolloutRun:
        self.failed, self.failure_kind = detail, kind
        return self


@attrs.define
class RolloutRunner:
    """Runs rollouts on the run's servers; `capture` says whether they ask for payloads.
    Every failure is recorded in `rejections` (training's and evals' are apart)."""

    config: Config
    state: RunState
    client: HTTP11Client
    pool: ServerPool
    rejections: Rejections
    capture: bool = True
    # Watches for a fleet that refuses every request (training's runner only): once it
    # does, `state.dispatch.refused` says why and no group starts any more.
    refusals: RefusalWatch | None = None
    # Where environments that drive their own turns call the model (None: none may).
    desk: ModelDesk | None = None
    # The last version's payload directory: one Path per version, not one per rollout.
    _last_payload_dir: tuple[int, Path] | None = attrs.field(default=None, init=False)
    # Whether rollouts write payload files (decided by the config once, not per rollout).
    _writes_files: bool = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        config = self.config
        self._writes_files = self.capture and config.by_handle and bool(config.payload.fields)

    @property
    def fields(self) -> tuple[str, ...]:
        """The payload fields its replies are read for (none without `capture`)."""
        return tuple(self.config.payload.fields) if self.capture else ()

    async def run(
        self,
        rollout_id: str,
        prompt: Prompt,
        episode: Episode | DrivenEpisode,
        server: str,
        stop: trio.Event,
    ) -> RolloutRun:
        """The rollout of `prompt` (its conversation: `episode`) on `server`, tagged with
        the applied version, ended after the request in flight once `stop` is set."""
        version = self.state.versions.applied
        payload_dir = self._payload_dir(version) if self._writes_files else None
        tokens = np.asarray(prompt.token_ids, dtype=TOKEN_DTYPE)
        run = RolloutRun(rollout_id, version, payload_dir, tokens, server=server, episode=episode)
        if isinstance(episode, DrivenEpisode):
            return await self._run_driven(run, prompt.sampling, episode, stop)
        # Delta replay: each turn asks for routing rows from where the previous turn's
        # rows ended (its last sampled token was never run forward), never for rows the
        # rollout already holds.
        routing_start = 0
        for turn_index in range(prompt.sampling.max_turns):
            if stop.is_set():
                return run.fail("stopped", "stopped: the group can no longer ship")
            try:
                turn = await self._turn(run, turn_index, prompt.sampling, routing_start, stop)
            except InferenceFailure as failure:
                return run.fail(failure.kind, str(failure))
            run.turns.append((len(run.tokens), turn))
            try:
                reply = await episode.reply(run.tokens, turn.completion_ids)
            except Exception as exc:  # user code: it fails this rollout, never the daemon
                detail = f"the environment failed after turn {turn_index} ({exc!r:.200})"
                self.rejections.record("environment", server, detail, rollout=rollout_id)
                return run.fail("environment", detail)
            if reply is None:
                run.tokens = np.concatenate([run.tokens, turn.completion_ids])
                break
            run.tokens = np.concatenate(
                [run.tokens, turn.completion_ids, np.asarray(reply, dtype=TOKEN_DTYPE)]
            )
            routing_start = len(run.tokens) - len(reply) - 1
        return run

    async def _turn(
        self,
        run: RolloutRun,
        turn_index: int,
        sampling: Sampling,
        routing_start: int,
        stop: trio.Event,
    ) -> TurnOutput:
        """Turn `turn_index` of `run`, with `run.tokens` as its prompt. Raises the last
        `InferenceFailure` once retries are spent."""
        config = self.config
        # Encoded once, kept as bytes while the request is in flight (and retried): a
        # list of thousands of Python ints would be work for every full collection.
        body = encode_generate_request(
            build_generate_request(
                request_id=f"{run.rollout_id}-t{turn_index}",
                token_ids=run.tokens,
                sampling=sampling,
                seed=_seed(config.seed, run.rollout_id, turn_index),
                payload_dir=run.payload_dir,
                routing_start=routing_start if "routed_experts" in self.fields else None,
                model=config.inference.model,
            )
        )
        return await self._request_turn(
            run.server, body, len(run.tokens), routing_start, run.payload_dir, stop
        )

    async def _run_driven(
        self, run: RolloutRun, sampling: Sampling, episode: DrivenEpisode, stop: trio.Event
    ) -> RolloutRun:
        """A rollout whose environment drives its turns: each of its calls to the model
        endpoint is run here as a turn (`_driven_turn`); once it ends, what it recorded
        must be what was sampled (docs/design.md § Environments that drive their turns)."""
        if self.desk is None:
            return run.fail("environment", "this runner has no model endpoint for driven envs")
        run_turn = functools.partial(self._driven_turn, run, sampling, stop)
        async with (
            self.desk.rollout(run_turn) as (model_url, calls),
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(calls.serve)
            driven = await episode.drive(model_url)
            nursery.cancel_scope.cancel()
        if run.failed is not None:
            return run
        problem = driven.error or _disagreement(driven, run)
        if problem is not None:
            kind = "environment" if driven.error else "trajectory_mismatch"
            self.rejections.record(kind, run.server, problem, rollout=run.rollout_id)
            return run.fail(kind, problem)
        run.metrics = _finite(driven.metrics)
        return run

    async def _driven_turn(
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
            turn = await self._turn(run, turn_index, turn_sampling, routing_start, stop)
        except InferenceFailure as failure:
            run.fail(failure.kind, str(failure))
            raise CallRefused(410, f"the inference server failed: {failure}") from None
        run.turns.append((len(run.tokens), turn))
        run.tokens = np.concatenate([run.tokens, turn.completion_ids])
        return turn

    def _payload_dir(self, version: int) -> Path:
        if self._last_payload_dir is None or self._last_payload_dir[0] != version:
            self._last_payload_dir = (version, version_dir(self.config.payload_root, version))
        return self._last_payload_dir[1]

    async def _request_turn(
        self,
        server: str,
        body: bytes,
        prompt_len: int,
        routing_start: int,
        payload_dir: Path | None,
        stop: trio.Event,
    ) -> TurnOutput:
        """One turn, retried on transient failures with exponential backoff.

        Each attempt has its own deadline. A reply that cannot be read is not asked for
        again: the same server would answer the same way (the rejection is logged at
        once with its reason). Raises the last `InferenceFailure`.
        """
        config = self.config
        attempt = 0
        while True:
            try:
                with trio.fail_after(config.inference.request_timeout_s):
                    raw = await post_generate(self.client, server, body)
                    # Parsing is a turn's largest piece of Python: in a later pass when
                    # this one is long (many replies at once).
                    await yield_if_pass_is_long()
                turn = parse_generate_response(
                    raw,
                    prompt_len=prompt_len,
                    routing_start=routing_start,
                    payload_dir=payload_dir,
                    fields=self.fields,
                    routing_shape=self.state.dispatch.routing_shape,
                )
            except trio.TooSlowError:
                failure = InferenceFailure("timeout", f"{server}: no answer in time")
            except InferenceFailure as exc:
                failure = exc
            except Exception as exc:
                # A parser bug met by a reply nobody foresaw: a rejected reply, never a
                # crash of the daemon.
                failure = InferenceFailure("malformed", f"unparseable reply ({exc!r:.200})")
            else:
                if self.refusals is not None:
                    self.refusals.answered()
                if turn.poisoned is not None:
                    self.rejections.record("poisoned_payload", server, turn.poisoned)
                elif self.capture and self.state.dispatch.routing_shape is None:
                    self._learn_routing_shape(turn, server)
                return turn
            if self.refusals is not None:
                self._watch_refusals(self.refusals, server, failure)
            attempt += 1
            retrying = (
                failure.transient and attempt <= config.inference.retries and not stop.is_set()
            )
            self.rejections.record(
                failure.kind, server, failure.detail, attempt=attempt, retrying=retrying
            )
            if failure.kind == "connect":
                self.pool.mark_down(server, failure.detail)
            if not retrying:
                raise failure
            await trio.sleep(min(config.inference.retry_backoff_s * 2 ** (attempt - 1), 30.0))

    def _watch_refusals(
        self, refusals: RefusalWatch, server: str, failure: InferenceFailure
    ) -> None:
        """Feed the refusal watch; end the dispatch when the whole fleet refuses."""
        if failure.kind not in REFUSAL_KINDS:
            if failure.kind not in NO_ANSWER_KINDS:
                refusals.answered()  # an answer, and not that refusal
            return
        ended = refusals.refused(trio.current_time(), server, failure.detail, self.pool.healthy())
        dispatch = self.state.dispatch
        if ended is not None and dispatch.refused is None:
            log.error("the fleet refuses every request: ending the run", error=ended)
            dispatch.refused = ended
            dispatch.stopping = True
            dispatch.refusal.set()
            self.state.notify()

    def _learn_routing_shape(self, turn: TurnOutput, server: str) -> None:
        """With no routing shape configured, the first good reply with routing fixes it
        for the run: every later reply must agree (docs/operations.md § Security model)."""
        rows = _routing_row_shape(turn)
        if rows is None or len(rows) != 2:
            return
        layers, top_k = rows
        self.state.dispatch.routing_shape = RoutingShape(layers, top_k)
        log.info(
            "routing shape fixed by the first reply", server=server, layers=layers, top_k=top_k
        )


def _routing_row_shape(turn: TurnOutput) -> tuple[int, ...] | None:
    """The row shape of the turn's routing, by handle or inline, if it has any."""
    segment = turn.segments.get("routed_experts")
    if segment is not None:
        return segment.shape[1:]
    inline = turn.inline.get("routed_experts")
    return None if inline is None else inline[0].shape[1:]


def _seed(run_seed: int, rollout_id: str, turn: int) -> int:
    digest = hashlib.blake2b(f"{run_seed}/{rollout_id}/{turn}".encode(), digest_size=4)
    return int.from_bytes(digest.digest(), "little")


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

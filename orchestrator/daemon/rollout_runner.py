"""A group's rollouts, turn by turn: their generate requests (retried on transient
failures), their environment's replies between turns, until each episode ends or fails.
A group's first turn is one request for all its rollouts when the config says so
(`Config.group_choices`: vLLM's `n`); each rollout's later turns are its own requests. An
environment that drives its own turns has each of its calls run as such a turn
(`driven_rollouts.py`).

Training rollouts capture payloads (each request names its version's payload directory
and where its routing rows start, docs/design.md §3, §4); eval rollouts
(`orchestrator.daemon.evaluation`) run the same turns without: no `payload_dir`, no
routing start, and their replies' payload arrays are not read.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import cast

import attrs
import msgspec
import numpy as np
import structlog
import trio

from orchestrator.config import Config
from orchestrator.core.arrays import TOKEN_DTYPE
from orchestrator.core.environments import (
    DrivenEpisode,
    Episode,
    Prompt,
    Sampling,
    drives_its_turns,
)
from orchestrator.core.refusals import NO_ANSWER_KINDS, REFUSAL_KINDS, RefusalWatch
from orchestrator.core.turns import TurnOutput
from orchestrator.daemon.driven_rollouts import DrivenRollouts
from orchestrator.daemon.inference.client import encode_generate_request, post_generate
from orchestrator.daemon.inference.http11 import HTTP11Client
from orchestrator.daemon.inference.model_endpoint import ModelDesk
from orchestrator.daemon.inference.server_pool import ServerPool
from orchestrator.daemon.pass_budget import yield_if_pass_is_long
from orchestrator.daemon.rejections import Rejections
from orchestrator.daemon.rollout_run import RolloutRun
from orchestrator.daemon.run_state import RunState
from orchestrator.payload import RoutingShape, version_dir
from orchestrator.wire import (
    InferenceFailure,
    TooFewChoices,
    build_generate_request,
    encoded_token_ids,
    parse_choice,
    reply_choices,
)

log = structlog.get_logger(__name__)


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
    # does, `state.dispatch.halt_reason` says why and no group starts any more.
    refusals: RefusalWatch | None = None
    # Where environments that drive their own turns call the model (None: none may).
    desk: ModelDesk | None = None
    # The last version's payload directory: one Path per version, not one per rollout.
    _last_payload_dir: tuple[int, Path] | None = attrs.field(default=None, init=False)
    # Whether rollouts write payload files (decided by the config once, not per rollout).
    _writes_files: bool = attrs.field(init=False)
    # Rollouts whose environment drives their turns (through `desk`).
    _driven: DrivenRollouts | None = attrs.field(default=None, init=False)
    # The last prompt's ids and their JSON: when a group's members send their own first
    # requests (`Config.group_choices` 1, and the evals' rollouts of one example), they
    # start one after the other with the same prompt, encoded once for them all.
    _last_prompt_json: tuple[np.ndarray, msgspec.Raw] | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        config = self.config
        self._writes_files = self.capture and config.by_handle and bool(config.payload.fields)
        if self.desk is not None:
            self._driven = DrivenRollouts(self.desk, self.rejections, self._turn)

    @property
    def fields(self) -> tuple[str, ...]:
        """The payload fields its replies are read for (none without `capture`)."""
        return tuple(self.config.payload.fields) if self.capture else ()

    async def run_group(
        self,
        runs: list[RolloutRun | None],
        group_id: str,
        prompt: Prompt,
        episodes: list[Episode | DrivenEpisode],
        server: str,
        stop: trio.Event,
    ) -> None:
        """The group's rollouts of `prompt` (rollout i's conversation: `episodes[i]`) on
        `server`, each put in `runs[i]` when it ends. With `config.group_choices` above 1
        and the daemon driving the turns, the first turn is one request for them all
        (`sampling_params.n`), and each goes on alone from its own choice."""
        version = self.state.versions.applied
        members = [
            self._new_run(f"{group_id}-r{index}", version, prompt, episode, server)
            for index, episode in enumerate(episodes)
        ]
        firsts: list[TurnOutput | InferenceFailure | None] = [None] * len(members)
        # (A group stopped before its request goes out sends none: each member stops.)
        # (A server that ignores `n` gets a request per rollout: `_first_turns`.)
        if (
            self.config.group_choices > 1
            and not stop.is_set()
            and not self.pool.ignores_n(server)
            and not any(drives_its_turns(type(episode)) for episode in episodes)
        ):
            firsts = await self._first_turns(group_id, members, prompt.sampling, stop)
        async with trio.open_nursery() as nursery:
            for index, run in enumerate(members):
                nursery.start_soon(
                    self._run_into,
                    runs,
                    index,
                    run,
                    episodes[index],
                    prompt.sampling,
                    firsts[index],
                    stop,
                )

    async def _run_into(
        self,
        runs: list[RolloutRun | None],
        index: int,
        run: RolloutRun,
        episode: Episode | DrivenEpisode,
        sampling: Sampling,
        first: TurnOutput | InferenceFailure | None,
        stop: trio.Event,
    ) -> None:
        runs[index] = await self._go_on(run, episode, sampling, first, stop)

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
        run = self._new_run(rollout_id, self.state.versions.applied, prompt, episode, server)
        return await self._go_on(run, episode, prompt.sampling, None, stop)

    def _new_run(
        self,
        rollout_id: str,
        version: int,
        prompt: Prompt,
        episode: Episode | DrivenEpisode,
        server: str,
    ) -> RolloutRun:
        payload_dir = self._payload_dir(version) if self._writes_files else None
        tokens = np.asarray(prompt.token_ids, dtype=TOKEN_DTYPE)
        return RolloutRun(rollout_id, version, payload_dir, tokens, server=server, episode=episode)

    async def _go_on(
        self,
        run: RolloutRun,
        episode: Episode | DrivenEpisode,
        sampling: Sampling,
        first: TurnOutput | InferenceFailure | None,
        stop: trio.Event,
    ) -> RolloutRun:
        """`run` (its conversation: `episode`) to its end, from its first turn when that
        came already (`first`)."""
        if drives_its_turns(type(episode)):
            if self._driven is None:
                return run.fail("environment", "this runner has no model endpoint for driven envs")
            return await self._driven.run(run, sampling, cast(DrivenEpisode, episode), stop)
        return await self._run_turns(run, sampling, cast(Episode, episode), first, stop)

    async def _first_turns(
        self, group_id: str, members: list[RolloutRun], sampling: Sampling, stop: trio.Event
    ) -> list[TurnOutput | InferenceFailure | None]:
        """The members' first turns, from one request with a choice for each (choice i is
        member i's: vLLM answers in index order). A failed request fails them all; a
        failed choice only its member. A server that answered fewer choices (it ignores
        `n`) gave the first members theirs; the others (None) send their own requests."""
        config, lead = self.config, members[0]
        body = encode_generate_request(
            build_generate_request(
                request_id=f"{group_id}-t0",
                token_ids=self._token_ids_json(lead.tokens),
                sampling=sampling,
                seed=_seed(config.seed, group_id, 0),
                payload_dir=lead.payload_dir,
                routing_start=0 if "routed_experts" in self.fields else None,
                model=config.inference.model,
                choices=len(members),
            )
        )
        try:
            turns: list[TurnOutput | InferenceFailure | None] = list(
                await self._request_turns(
                    lead.server, body, len(members), len(lead.tokens), 0, lead.payload_dir, stop
                )
            )
        except InferenceFailure as failure:
            return [failure] * len(members)
        return turns + [None] * (len(members) - len(turns))

    async def _run_turns(
        self,
        run: RolloutRun,
        sampling: Sampling,
        episode: Episode,
        first: TurnOutput | InferenceFailure | None,
        stop: trio.Event,
    ) -> RolloutRun:
        """The daemon's own turns of `run`, each reply from `episode`, until it ends; its
        first turn is `first` when that came already."""
        rollout_id, server = run.rollout_id, run.server
        # Delta replay: each turn asks for routing rows from where the previous turn's
        # rows ended (its last sampled token was never run forward), never for rows the
        # rollout already holds.
        routing_start = 0
        for turn_index in range(sampling.max_turns):
            if stop.is_set():
                return run.fail("stopped", "stopped: the group can no longer ship")
            if turn_index == 0 and first is not None:
                outcome = first
            else:
                try:
                    outcome = await self._turn(run, turn_index, sampling, routing_start, stop)
                except InferenceFailure as failure:
                    outcome = failure
            if isinstance(outcome, InferenceFailure):
                return run.fail(outcome.kind, str(outcome))
            turn = outcome
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
                token_ids=self._token_ids_json(run.tokens),
                sampling=sampling,
                seed=_seed(config.seed, run.rollout_id, turn_index),
                payload_dir=run.payload_dir,
                routing_start=routing_start if "routed_experts" in self.fields else None,
                model=config.inference.model,
            )
        )
        outcomes = await self._request_turns(
            run.server, body, 1, len(run.tokens), routing_start, run.payload_dir, stop
        )
        return _outcome(outcomes[0])

    def _token_ids_json(self, tokens: np.ndarray) -> msgspec.Raw:
        """`tokens` as JSON, from the last prompt's when they are the same array (a
        group's first turn; held here, so never another array at a reused address)."""
        last = self._last_prompt_json
        if last is not None and last[0] is tokens:
            return last[1]
        encoded = encoded_token_ids(tokens)
        self._last_prompt_json = (tokens, encoded)
        return encoded

    def _payload_dir(self, version: int) -> Path:
        if self._last_payload_dir is None or self._last_payload_dir[0] != version:
            self._last_payload_dir = (version, version_dir(self.config.payload_root, version))
        return self._last_payload_dir[1]

    async def _request_turns(
        self,
        server: str,
        body: bytes,
        choices: int,
        prompt_len: int,
        routing_start: int,
        payload_dir: Path | None,
        stop: trio.Event,
    ) -> list[TurnOutput | InferenceFailure]:
        """One request's `choices` turns (fewer from a server that ignores `n`: what it
        answered), the request retried on transient failures with exponential backoff.

        Each attempt has its own deadline. A reply that cannot be read is not asked for
        again: the same server would answer the same way (the rejection is logged at
        once with its reason). A choice that cannot be read is that choice's
        `InferenceFailure`, the others' turns stand. Raises the last `InferenceFailure`
        of the request.
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
                try:
                    parts = reply_choices(raw, choices)
                except TooFewChoices as fewer:
                    # A server (or a proxy) that ignores `n`: the choices it gave are
                    # good; the members left without one ask alone (`_first_turns`).
                    self.pool.note_ignores_n(server, fewer.asked, len(fewer.choices))
                    parts = fewer.choices
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
                outcomes: list[TurnOutput | InferenceFailure] = []
                for index, part in enumerate(parts):
                    if index:
                        await yield_if_pass_is_long()
                    outcome = self._parse_choice(
                        part, index, prompt_len, routing_start, payload_dir
                    )
                    self._note_outcome(outcome, server, attempt + 1)
                    outcomes.append(outcome)
                return outcomes
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

    def _parse_choice(
        self,
        part: msgspec.Raw,
        index: int,
        prompt_len: int,
        routing_start: int,
        payload_dir: Path | None,
    ) -> TurnOutput | InferenceFailure:
        try:
            return parse_choice(
                part,
                index,
                prompt_len=prompt_len,
                routing_start=routing_start,
                payload_dir=payload_dir,
                fields=self.fields,
                routing_shape=self.state.dispatch.routing_shape,
            )
        except InferenceFailure as failure:
            return failure
        except Exception as exc:  # as for a whole reply: rejected, never a crash
            return InferenceFailure("malformed", f"unparseable reply ({exc!r:.200})")

    def _note_outcome(
        self, outcome: TurnOutput | InferenceFailure, server: str, attempt: int
    ) -> None:
        """Count a choice that failed or came poisoned; learn the routing shape from the
        first good one when the config does not fix it."""
        if isinstance(outcome, InferenceFailure):
            self.rejections.record(
                outcome.kind, server, outcome.detail, attempt=attempt, retrying=False
            )
        elif outcome.poisoned is not None:
            self.rejections.record("poisoned_payload", server, outcome.poisoned)
        elif self.capture and self.state.dispatch.routing_shape is None:
            self._learn_routing_shape(outcome, server)

    def _watch_refusals(
        self, refusals: RefusalWatch, server: str, failure: InferenceFailure
    ) -> None:
        """Feed the refusal watch; end the dispatch when the whole fleet refuses."""
        if failure.kind not in REFUSAL_KINDS:
            if failure.kind not in NO_ANSWER_KINDS:
                refusals.answered()  # an answer, and not that refusal
            return
        ended = refusals.refused(trio.current_time(), server, failure.detail, self.pool.healthy())
        if ended is not None and self.state.dispatch.halt("refused", f"error: {ended}"):
            log.error("the fleet refuses every request: ending the run", error=ended)
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


def _outcome(outcome: TurnOutput | InferenceFailure) -> TurnOutput:
    if isinstance(outcome, InferenceFailure):
        raise outcome
    return outcome


def _seed(run_seed: int, name: str, turn: int) -> int:
    """A request's seed: of a rollout's turn, or of a group's first (vLLM adds the choice's
    index)."""
    digest = hashlib.blake2b(f"{run_seed}/{name}/{turn}".encode(), digest_size=4)
    return int.from_bytes(digest.digest(), "little")

"""Environments that drive their own turns (`DrivenEpisode`, as a verifiers environment
does) through the daemon's loopback model endpoint, against the local fleet: each call is
run as the daemon's own turn (version, payload files by handle, routing), the sample is
built from what the daemon sampled, and an environment whose record or conversation
disagrees with it is refused and counted.

The environment here is written as verifiers' tokens-in/tokens-out client speaks: it
POSTs the whole conversation's `token_ids` to `{model_url}/inference/v1/generate`, reads
`choices[0].token_ids` and the `token_id:<id>` logprobs, and appends a reply of its own
before the next call."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

import attrs
import httpx
import numpy as np
import pytest
import trio

from orchestrator.config import Config, load_config
from orchestrator.core.environments import Driven, Prompt, Sampling, ScoreFailed
from orchestrator.daemon import RunOutcome, run_daemon
from orchestrator.handoff import BATCH_FILE, read_batch_file
from orchestrator.httpx_body import request_bytes
from orchestrator.sim.fleet import serve_local_fleet

SIM = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"
STEPS = 3


def sim_config(run_dir: Path, *overrides: str) -> Config:
    return load_config(
        SIM,
        [
            f'run_dir="{run_dir}"',
            "sim.train_time_s=0.02",
            "trainer.poll_interval_s=0.1",
            # Rewards of 0 and 1 by chance: no group is too hard to train on.
            "batch.curriculum_min_mean_reward=0.0",
            *overrides,
        ],
    )


@attrs.define
class ToolLikeEpisode:
    """Two calls: the prompt, then the prompt, the completion and a "tool result" of its
    own. `how` breaks it on purpose: "rerender" sends a second conversation that does not
    extend the first, "misrecord" reports a completion the server never sampled, "flaky"
    reports a failed call besides its well-run ones."""

    prompt_ids: tuple[int, ...]
    how: str = "well"
    _reward: float | None = None

    async def drive(self, model_url: str) -> Driven:
        completions: list[tuple[int, ...]] = []
        tokens = list(self.prompt_ids)
        async with httpx.AsyncClient(base_url=model_url, timeout=30) as client:
            models = (await client.get("/v1/models")).json()
            assert models["data"][0]["max_model_len"] == 2048
            for turn in range(2):
                call = {"model": "m", "token_ids": tokens, "sampling_params": {"max_tokens": 8}}
                # The body in one chunk: a request cut off when the run ends leaves no
                # async generator behind (orchestrator.httpx_body).
                answer = await request_bytes(
                    client, "POST", "/inference/v1/generate", json.dumps(call).encode(), headers={}
                )
                if answer.status_code != 200:
                    return Driven(None, tuple(completions), error=answer.json()["error"]["message"])
                choice = answer.json()["choices"][0]
                ids = choice["token_ids"]
                logprobs = choice["logprobs"]["content"]
                assert [entry["token"] for entry in logprobs] == [f"token_id:{i}" for i in ids]
                completions.append(tuple(ids))
                tokens = tokens + ids + [7, 8, 9]  # the tool's answer, rendered by the env
                if self.how == "rerender" and turn == 0:
                    tokens = [5, *tokens[1:]]
        if self.how == "misrecord":
            completions[-1] = (*completions[-1], 1)
        self._reward = float(sum(completions[0]) % 2)
        # "flaky": a call failed on its way and was retried (what a relay's 502 is).
        failed = ((502, "bad gateway"),) if self.how == "flaky" else ()
        return Driven(self._reward, tuple(completions), metrics={"turns": 2.0}, failed_calls=failed)

    async def score(self, completions: Sequence[np.ndarray]) -> float:
        if self._reward is None:
            raise ScoreFailed("raised", "the episode ended without a reward")
        return self._reward


@attrs.frozen
class ToolLikeEnvironment:
    how: str = "well"
    name: str = "tool-like"

    async def prompt(self, index: int) -> Prompt:
        ids = tuple(range(10 + index % 7, 30 + index % 7))
        return Prompt(
            f"p{index}", (), env=self.name, info={"ids": ids}, sampling=Sampling(8, max_turns=2)
        )

    def episode(self, prompt: Prompt) -> ToolLikeEpisode:
        return ToolLikeEpisode(prompt.info["ids"], self.how)


async def run(config: Config, environment: ToolLikeEnvironment) -> RunOutcome:
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(serve_local_fleet, config)
        outcome = await run_daemon(
            config, servers=urls, environment=environment, handoff=config.handoff
        )
        nursery.cancel_scope.cancel()
    return outcome


@pytest.mark.slow
async def test_a_driven_environment_trains_through_the_daemons_turns(tmp_path: Path) -> None:
    config = sim_config(tmp_path / "run", f"max_steps={STEPS}")
    with trio.fail_after(120):
        outcome = await run(config, ToolLikeEnvironment())
    dispatch = outcome.state.dispatch
    assert outcome.state.shipping.last_shipped == STEPS
    assert dispatch.failures["trajectory_mismatch"] == 0
    assert dispatch.rollouts["completed"] >= STEPS * 16
    batch = read_batch_file(config.batches_dir / f"step_{STEPS:06d}" / BATCH_FILE)
    assert len(batch.samples) == 16
    for sample in batch.samples:
        # The prompt the environment rendered, then the first completion, its own three
        # tokens, the second completion: the daemon's turns, stitched.
        tokens = sample.token_ids.tolist()
        assert tokens[:20] == list(range(tokens[0], tokens[0] + 20))
        first = len(tokens) - 20 - 3
        assert 2 <= first <= 16
        # Routing by handle over both turns, as for the daemon's own rollouts, and read
        # back by the trainer.
        assert sample.payload["routed_experts"]
    report = json.loads((config.run_dir / "trainer" / "report.json").read_text())
    assert report["steps"] == STEPS and report["violations"] == []
    # The environment's own metrics reach its tally.
    assert outcome.sink.by_env["tool-like"].metrics.means() == {"turns": 2.0}


@pytest.mark.parametrize("how", ["rerender", "misrecord"])
async def test_an_environment_that_disagrees_with_what_was_sampled_is_refused(
    tmp_path: Path, how: str
) -> None:
    config = sim_config(tmp_path / "run", "max_steps=0")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(serve_local_fleet, config)
            start = functools.partial(
                run_daemon,
                config,
                servers=urls,
                environment=ToolLikeEnvironment(how),
                handoff=config.handoff,
            )
            state = await nursery.start(lambda task_status: start(task_status=task_status))
            while state.dispatch.failures["trajectory_mismatch"] < 8:
                await state.wait_changed()
            nursery.cancel_scope.cancel()
    assert state.dispatch.rollouts["completed"] == 0
    texts = [
        text for (kind, text) in state.dispatch.rejections.texts() if kind == "trajectory_mismatch"
    ]
    expected = "do not extend" if how == "rerender" else "differ from"
    assert texts and all(expected in text for text in texts)


async def test_the_model_calls_an_environment_saw_fail_are_the_runs_failures(
    tmp_path: Path,
) -> None:
    config = sim_config(tmp_path / "run", "max_steps=0")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(serve_local_fleet, config)
            start = functools.partial(
                run_daemon,
                config,
                servers=urls,
                environment=ToolLikeEnvironment("flaky"),
                handoff=config.handoff,
            )
            state = await nursery.start(lambda task_status: start(task_status=task_status))
            # Counted, and the rollouts that reported them went on to complete.
            while (
                state.dispatch.failures["model_call"] < 8
                or state.dispatch.rollouts["completed"] < 8
            ):
                await state.wait_changed()
            nursery.cancel_scope.cancel()
    texts = [text for (kind, text) in state.dispatch.rejections.texts() if kind == "model_call"]
    assert texts == ["a model call of the environment failed: HTTP 502: bad gateway"]

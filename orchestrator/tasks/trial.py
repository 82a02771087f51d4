"""`check-config`'s trial of the user's code, in a reward worker as the run has one.

Importing a reward module in the daemon proves little: a reward whose library is missing
can import (it imports the library in its `prepare`, or inside the function) and then
fail every rollout of the run. So `try_tasks` does what the run's first minute would:

- every reward function's `prepare` runs in a spawned reward worker, started as the run
  starts its workers (`start_reward_worker`'s signals and niceness, the daemon's
  `sys.path`), and a module that does not import there or a `prepare` that raises is
  one line;
- one row of each dataset env and one episode of each plugin env is read and rendered as
  the run does (the first usable position of its order: a row skipped is said so), and
  scored by each of its reward functions alone in that worker, with the row's answer as
  the completion (an empty one without an answer).

Each problem is one `UserError` line naming the env's key and name, the reward and the
exception's last line. What went well comes back as lines for check-config's report.
With `[rewards] executor = "ray"` the trial still runs in a local worker: it checks the
code, not the cluster. A verifiers env is loaded by its own worker (`build.check_tasks`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import trio
import trio_parallel

from orchestrator.core.environments import Prompt, PromptSkipped, ScoreFailed
from orchestrator.errors import UserError
from orchestrator.tasks.chat import ChatTokenizer
from orchestrator.tasks.dataset_env import DatasetEnvironment
from orchestrator.tasks.plugin_env import PluginEnvironment
from orchestrator.tasks.reward_functions import RewardSpec, prepare_rewards
from orchestrator.tasks.reward_pool import RewardPool

#: Positions tried for a usable row before the env is reported as having none.
TRIAL_POSITIONS = 20
#: A worker's spawn, its imports and every `prepare` (a model to load) get this long.
PREPARE_DEADLINE_S = 300.0


@attrs.frozen
class TrialEnv:
    """One env to try: its config key (`env[0]`), its name, and the environment the run
    would build for it (a dataset or a plugin env)."""

    key: str
    name: str
    environment: DatasetEnvironment | PluginEnvironment


async def prepare_in_worker(
    pool: RewardPool, keyed_specs: Sequence[tuple[str, RewardSpec]]
) -> None:
    """Run every reward's `prepare` in a worker of `pool` (opened without `preload`, so
    its worker imports them here, once). Raises `UserError` naming the first env key and
    reward whose import or `prepare` failed there."""
    paths = tuple(dict.fromkeys(spec.path for _, spec in keyed_specs))
    if not paths:
        return
    try:
        failures = await pool.run_in_worker(prepare_rewards, paths, deadline_s=PREPARE_DEADLINE_S)
    except trio.TooSlowError:
        raise UserError(
            f"the rewards' prepare() did not end within {PREPARE_DEADLINE_S:g} s in a reward "
            f"worker: {', '.join(paths)}"
        ) from None
    except trio_parallel.BrokenWorkerError as exc:
        raise UserError(
            f"a reward worker died importing or preparing {', '.join(paths)}: {exc}"
        ) from None
    for path, error in failures:
        key = next(key for key, spec in keyed_specs if spec.path == path)
        raise UserError(f"{key}: reward {path}: in a reward worker, {error}")


async def try_envs(envs: Sequence[TrialEnv]) -> list[str]:
    """Score one row (or episode) of each of `envs` by each of its reward functions (in
    the reward pool the envs were built with). Returns a line per env saying what was
    scored; raises `UserError` for the first failure."""
    return [await _try_env(trial, trial.environment) for trial in envs]


async def _try_env(trial: TrialEnv, environment: DatasetEnvironment | PluginEnvironment) -> str:
    prompt, skipped = await _first_prompt(trial, environment)
    answer = _answer(prompt)
    completion = _completion_ids(environment.tokenizer, answer)
    where = _where(prompt)
    scores: list[str] = []
    rewards: tuple[RewardSpec | None, ...] = environment.rewards or (None,)
    for spec in rewards:
        alone = environment if spec is None else attrs.evolve(environment, rewards=(spec,))
        episode = alone.episode(prompt)
        name = "score()" if spec is None else spec.path
        try:
            if isinstance(alone, PluginEnvironment):
                # The plugin's next step after the reply, as a rollout's turn would.
                await episode.reply(prompt.token_ids, completion)
            score = await episode.score([completion])
        except ScoreFailed as failed:
            raise UserError(
                f"{trial.key} {trial.name}: reward {name} failed on {where}: {failed.detail}"
            ) from None
        except Exception as exc:
            raise UserError(
                f"{trial.key} {trial.name}: {where} failed: {type(exc).__name__}: {exc}"
            ) from None
        scores.append(f"{name} = {score:g}")
    given = "its answer" if answer else "empty"
    note = f" ({skipped} skipped before it)" if skipped else ""
    return f"{trial.key} {trial.name}: {where} scored{note}, completion {given}: " + ", ".join(
        scores
    )


async def _first_prompt(
    trial: TrialEnv, environment: DatasetEnvironment | PluginEnvironment
) -> tuple[Prompt, int]:
    """The env's first usable prompt and how many positions were skipped before it."""
    reason = ""
    for position in range(TRIAL_POSITIONS):
        try:
            return await environment.prompt(position), position
        except PromptSkipped as skipped:
            reason = skipped.reason
        except UserError as exc:  # every row skipped: the env's own line names it
            raise UserError(f"{trial.key}: {exc}") from None
    raise UserError(
        f"{trial.key} {trial.name}: the first {TRIAL_POSITIONS} prompts are all skipped, "
        f"the last: {reason}"
    )


def _where(prompt: Prompt) -> str:
    info = prompt.info
    if "row_index" in info:
        return f"row {info['row_index']}"
    return f"episode {info.get('index', 0)}"


def _answer(prompt: Prompt) -> str:
    info: dict[str, Any] = dict(prompt.info)
    answer = info.get("answer", (info.get("info") or {}).get("answer"))
    if answer is None or (isinstance(answer, float) and math.isnan(answer)):
        return ""
    return str(answer)


def _completion_ids(tokenizer: ChatTokenizer, text: str) -> np.ndarray:
    ids = tokenizer.tokenizer.encode(text, add_special_tokens=False) if text else []
    return np.asarray(ids, dtype=np.int32)

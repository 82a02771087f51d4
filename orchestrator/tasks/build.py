"""The run's environment of real tasks, from its `[model]`, `[[env]]` and `[rewards]`.

`load_tasks` does everything that can fail on bad input, before the run touches anything:
`load_envs` opens every dataset and checks its columns and imports every reward function,
for the `[[env]]`s and the `[[eval.env]]`s alike, and `load_tokenizer` loads the tokenizer
(a chat template required). Each problem is one `UserError` line naming the key;
`orchestrator check-config` calls `load_tasks`, and `orchestrator run` its two parts
(before the payload root is wiped) in `open_tasks`, which also opens the reward pool and
hands out what the daemon runs: the environment it trains on
(the one `[[env]]`, or their mixture by `ratio`) and the eval tasks. An env is a dataset
scored by reward functions (`dataset_env.py`), a plugin built by its factory
(`plugin_env.py`), or an environment written for verifiers, served by a worker process
(`verifiers_env/`): `load_tasks` only checks that verifiers is installed (its import takes
seconds, and it never runs in the daemon); `check_tasks` and `open_tasks` start its worker,
which loads it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, ParamSpec, TypeVar

import attrs
import structlog
import trio

from orchestrator.config import Config, EnvConfig
from orchestrator.core.environments import Environment, Sampling
from orchestrator.core.evals import EvalTask
from orchestrator.errors import UserError
from orchestrator.tasks.chat import ChatTokenizer
from orchestrator.tasks.dataset_env import DatasetEnvironment, PromptColumns
from orchestrator.tasks.datasets import DataOrder, Dataset, open_dataset, require_columns
from orchestrator.tasks.mixture import EnvironmentMixture
from orchestrator.tasks.plugin_env import PluginEnvironment
from orchestrator.tasks.ray_rewards import import_ray, open_ray_reward_pool
from orchestrator.tasks.reward_functions import RewardSpec, import_callable, load_reward
from orchestrator.tasks.reward_pool import RewardExecutor, open_reward_pool
from orchestrator.tasks.trial import TrialEnv, prepare_in_worker, try_envs
from orchestrator.tasks.verifiers_env.environment import (
    VerifiersEnvironment,
    WorkerSpec,
    open_verifiers_environments,
)
from orchestrator.tasks.verifiers_env.protocol import INSTALL_LINE, verifiers_installed

log = structlog.get_logger(__name__)

P = ParamSpec("P")
T = TypeVar("T")


@attrs.frozen
class LoadedEnv:
    config: EnvConfig
    rewards: tuple[RewardSpec, ...]
    dataset: Dataset | None = None  # a dataset env
    plugin: Any = None  # a plugin env: what its factory built


@attrs.frozen
class LoadedEnvs:
    """What `load_envs` opened: close it when done (`close`)."""

    envs: tuple[LoadedEnv, ...]
    evals: tuple[LoadedEnv, ...] = ()

    def close(self) -> None:
        for env in (*self.envs, *self.evals):
            if env.dataset is not None:
                env.dataset.close()

    @property
    def rewards(self) -> list[RewardSpec]:
        """The reward functions of every env and eval env, in order."""
        return [spec for env in (*self.envs, *self.evals) for spec in env.rewards]


def user_module_path() -> None:
    """Let "module:function" paths name modules in the current directory, as `python -m`
    would (a console script's own folder is first on `sys.path`, not the directory it
    runs in). Reward worker processes are spawned with this process's `sys.path`."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


def load_tasks(config: Config) -> tuple[LoadedEnvs, ChatTokenizer]:
    """`load_envs`, then `load_tokenizer`: everything of the tasks that can fail on bad
    input. Blocking (file reads, imports). Raises `UserError`, one line naming the key."""
    envs = load_envs(config)
    try:
        return envs, load_tokenizer(config)
    except BaseException:
        envs.close()
        raise


def load_envs(config: Config) -> LoadedEnvs:
    """Open and check the datasets and import the reward functions (and build the plugins)
    of `config`'s `[[env]]`s and `[[eval.env]]`s. Blocking (file reads, imports). Raises
    `UserError`, one line naming the key, for anything that does not load."""
    if config.rewards.executor == "ray":
        import_ray()  # one line now, rather than once the run has started
    user_module_path()
    envs: list[LoadedEnv] = []
    evals: list[LoadedEnv] = []
    try:
        for index, env in enumerate(config.env):
            envs.append(_load_env(f"env[{index}]", env))
        for index, env in enumerate(config.eval.env):
            evals.append(_load_env(f"eval.env[{index}]", env))
    except BaseException:
        LoadedEnvs(tuple(envs), tuple(evals)).close()
        raise
    return LoadedEnvs(tuple(envs), tuple(evals))


def load_tokenizer(config: Config) -> ChatTokenizer:
    """The `[model] tokenizer` with its chat template (transformers' import and the load:
    a second or more). Blocking. Raises `UserError` naming the key."""
    assert config.model.tokenizer is not None  # the config requires it with any [[env]]
    return _keyed(
        "model.tokenizer",
        ChatTokenizer.load,
        config.model.tokenizer,
        require_chat_template=True,
        template_kwargs=config.model.chat_template_kwargs,
    )


def _load_env(key: str, env: EnvConfig) -> LoadedEnv:
    if env.factory is not None:
        return _load_plugin(key, env, env.factory)
    if env.verifiers is not None:
        # Loaded by its worker (`check_tasks`, `open_tasks`); here only what it needs.
        if not verifiers_installed():
            raise UserError(f"{key}.verifiers: verifiers is not installed: {INSTALL_LINE}")
        return LoadedEnv(env, ())
    assert env.dataset is not None
    dataset = _keyed(f"{key}.dataset", open_dataset, env.dataset)
    try:
        columns = {
            f"{key}.{name}": column
            for name, column in (
                ("prompt", env.prompt),
                ("messages", env.messages),
                ("answer", env.answer),
            )
            if column is not None
        }
        require_columns(dataset, columns)
        rewards = _load_rewards(key, env)
    except BaseException:
        dataset.close()
        raise
    return LoadedEnv(env, rewards, dataset=dataset)


def _load_rewards(key: str, env: EnvConfig) -> tuple[RewardSpec, ...]:
    return tuple(
        _keyed(f"{key}.rewards[{i}]", load_reward, path, weight)
        for i, (path, weight) in enumerate(zip(env.rewards, env.weights, strict=True))
    )


def _load_plugin(key: str, env: EnvConfig, path: str) -> LoadedEnv:
    """Build the plugin: its factory called with `args`, its methods checked."""
    factory = _keyed(f"{key}.factory", import_callable, path, "factory")
    try:
        plugin = factory(**env.args)
    except Exception as exc:
        raise UserError(f"{key}.factory: {path}(**args) raised {exc!r:.300}") from None
    for method in ("prompt", "step"):
        if not callable(getattr(plugin, method, None)):
            raise UserError(
                f"{key}.factory: {path} built a {type(plugin).__name__} without a {method}() "
                "method (a plugin environment has prompt(index) and step(messages, info))"
            )
    rewards = _load_rewards(key, env)
    if not rewards and not callable(getattr(plugin, "score", None)):
        raise UserError(
            f"{key}.rewards: {path} built a {type(plugin).__name__} without a score() "
            "method: list reward functions to score its episodes"
        )
    return LoadedEnv(env, rewards, plugin=plugin)


def _keyed(key: str, load: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`load(...)`, its `UserError` prefixed with the config key it concerns."""
    try:
        return load(*args, **kwargs)
    except UserError as exc:
        message = str(exc)
        raise UserError(message if message.startswith(key) else f"{key}: {message}") from None


def check_tasks(config: Config) -> list[str]:
    """`load_tasks`, then the trial of the user's code in a reward worker (`trial.py`:
    every reward's `prepare`, one row of each dataset or plugin env scored by each of its
    rewards), and every verifiers environment loaded by its worker and stopped: the
    start-up check of `check-config`. Returns a line per env tried. Raises `UserError`,
    one line. Not from inside a trio run."""
    if not (config.env or config.eval.env):
        return []
    envs, tokenizer = load_tasks(config)
    try:
        lines = trio.run(_try_in_worker, config, envs, tokenizer)
    finally:
        envs.close()
    if any(env.verifiers is not None for env in (*config.env, *config.eval.env)):
        trio.run(_check_verifiers, config)
    return lines


async def _try_in_worker(config: Config, envs: LoadedEnvs, tokenizer: ChatTokenizer) -> list[str]:
    keyed = [
        *((f"env[{index}]", env) for index, env in enumerate(envs.envs)),
        *((f"eval.env[{index}]", env) for index, env in enumerate(envs.evals)),
    ]
    # No `preload`: the worker imports the rewards and runs their `prepare` as its first
    # job, which says what failed (a worker's start-up hook only counts on later calls).
    async with open_reward_pool(1, config.rewards.timeout_s, log_failures=False) as pool:
        await prepare_in_worker(
            pool,
            [
                (f"{key}.rewards[{i}]", spec)
                for key, env in keyed
                for i, spec in enumerate(env.rewards)
            ],
        )
        trials = []
        for key, env in keyed:
            if env.config.verifiers is not None:
                continue
            environment = _environment(config, env, tokenizer, pool)
            assert isinstance(environment, DatasetEnvironment | PluginEnvironment)
            trials.append(TrialEnv(key, env.config.name, environment))
        return await try_envs(trials)


async def _check_verifiers(config: Config) -> None:
    """Start every verifiers environment's worker, wait for its `hello`, stop it."""
    keyed = _verifiers_environments(config)
    for environment in keyed.values():
        environment.relay_log = False  # its one line is the check's answer
    async with open_verifiers_environments(list(keyed.values())):
        for key, environment in keyed.items():
            if key.startswith("eval."):
                _verifiers_eval_examples(config, key, environment)


def _verifiers_environments(
    config: Config, stop_token_ids: tuple[int, ...] = ()
) -> dict[str, VerifiersEnvironment]:
    """A `VerifiersEnvironment` (not started) for each `[[env]]` and `[[eval.env]]` with
    `verifiers`, by its config key (`env[0]`, `eval.env[1]`)."""
    environments: dict[str, VerifiersEnvironment] = {}
    for section, envs in (("env", config.env), ("eval.env", config.eval.env)):
        for index, env in enumerate(envs):
            if env.verifiers is not None:
                key = f"{section}[{index}]"
                environments[key] = _verifiers_environment(config, env, key, stop_token_ids)
    return environments


def _verifiers_environment(
    config: Config, env: EnvConfig, key: str, stop_token_ids: tuple[int, ...]
) -> VerifiersEnvironment:
    assert env.verifiers is not None and config.model.tokenizer is not None
    spec = WorkerSpec(
        name=env.name,
        verifiers=env.verifiers,
        tokenizer=config.model.tokenizer,
        args=env.args,
        max_turns=env.max_turns,
        renderer=env.renderer,
        chat_template_kwargs=config.model.chat_template_kwargs,
    )
    sampling = _sampling(env, stop_token_ids, max_turns=env.max_turns)
    # The model's name as the daemon's endpoint gives it (`GET /v1/models`), so that
    # verifiers reads its context length there.
    return VerifiersEnvironment(
        spec, sampling, model=config.inference.model, seed=config.seed, key=f"{key}.verifiers"
    )


def _verifiers_eval_examples(config: Config, key: str, environment: VerifiersEnvironment) -> int:
    """The prompts of each eval of a verifiers env: `eval.num_examples`, at most its
    tasks; an infinite taskset needs the count set."""
    wanted = config.eval.num_examples
    count = environment.tasks
    if count is None:
        if wanted < 1:
            raise UserError(
                f"eval.num_examples = {wanted} must be set (at least 1) for {key} "
                f"{environment.name!r}: its verifiers taskset is infinite"
            )
        return wanted
    return count if wanted < 0 else max(1, min(wanted, count))


@attrs.frozen
class Tasks:
    """What a run's real tasks give the daemon: the environment it trains on (None when
    it lists no `[[env]]`: the simulator's toy one then) and the eval tasks."""

    environment: Environment | None
    evals: tuple[EvalTask, ...] = ()
    #: The `[model]` tokenizer's vocabulary size and end-of-turn id, which the local
    #: fleet's servers follow unless `[sim]` sets them (None: no tokenizer loaded).
    model_tokens: tuple[int, int] | None = None


@asynccontextmanager
async def open_tasks(config: Config) -> AsyncIterator[Tasks]:
    """The environment of `config`'s `[[env]]`s and the tasks of its `[[eval.env]]`s,
    with their reward pool open while they are used. Raises `UserError` (from
    `load_envs`, `load_tokenizer`) before anything starts.

    The envs load first (datasets, the reward functions' imports: quick), then the reward
    workers start while the tokenizer loads: a worker's spawn and imports and
    transformers' import take a second or more each, and the workers run on other cores.
    The workers are still starting when this yields; the first scores wait for them. (A
    Ray pool connects to its cluster and warms it up as it opens, before the tokenizer.)"""
    loaded = await trio.to_thread.run_sync(load_envs, config)
    try:
        specs = loaded.rewards
        async with open_rewards(config, specs) as pool:
            tokenizer = await _load_tokenizer_logged(config)
            driven = _verifiers_environments(config, tokenizer.stop_token_ids)
            async with open_verifiers_environments(list(driven.values())):
                environments = [
                    _environment(config, env, tokenizer, pool, driven.get(f"env[{index}]"))
                    for index, env in enumerate(loaded.envs)
                ]
                environment: Environment | None = None
                if len(environments) == 1:
                    environment = environments[0]
                elif environments:
                    environment = EnvironmentMixture(
                        environments, [env.ratio for env in config.env], seed=config.seed
                    )
                evals = tuple(
                    EvalTask(
                        env.config.name,
                        _environment(
                            config, env, tokenizer, pool, driven.get(f"eval.env[{index}]")
                        ),
                        _eval_examples(config, env, driven.get(f"eval.env[{index}]"), index),
                    )
                    for index, env in enumerate(loaded.evals)
                )
                yield Tasks(environment, evals, model_tokens(tokenizer))
    finally:
        loaded.close()


def model_tokens(tokenizer: ChatTokenizer) -> tuple[int, int]:
    """The tokenizer's vocabulary size and the id a completion ends with (its eos, the
    first of its stop ids)."""
    ids = tokenizer.stop_token_ids
    return tokenizer.vocab_size, ids[0] if ids else 0


async def _load_tokenizer_logged(config: Config) -> ChatTokenizer:
    """`load_tokenizer` in a thread, logged before and after: the daemon's first lines,
    while transformers' import takes its second or two (a folder that is missing or
    holds no tokenizer is refused before, in one line with nothing logged)."""
    folder = config.model.tokenizer
    assert folder is not None  # the config requires it with any [[env]]
    await trio.to_thread.run_sync(_keyed, "model.tokenizer", ChatTokenizer.check_folder, folder)
    log.info(
        "loading tokenizer",
        folder=str(folder),
        envs=[env.name for env in config.env],
        evals=[env.name for env in config.eval.env],
    )
    started = time.perf_counter()
    tokenizer = await trio.to_thread.run_sync(load_tokenizer, config)
    log.info(
        "tokenizer loaded",
        vocab_size=tokenizer.vocab_size,
        seconds=round(time.perf_counter() - started, 2),
    )
    return tokenizer


def open_rewards(
    config: Config, specs: Sequence[RewardSpec]
) -> AbstractAsyncContextManager[RewardExecutor]:
    """Where the rewards of `specs` run, as `[rewards] executor` says."""
    rewards = config.rewards
    if rewards.executor == "ray":
        return open_ray_reward_pool(
            rewards.address,
            rewards.workers,
            rewards.timeout_s,
            runtime_env=rewards.ray_runtime_env,
            preload=specs,
        )
    workers = rewards.workers or os.cpu_count() or 1
    # No reward functions (verifiers envs, plugins that score themselves): no worker
    # process to start (the pool would still start one for a first call).
    return open_reward_pool(workers, rewards.timeout_s, preload=specs, start=bool(specs))


def _eval_examples(
    config: Config,
    loaded: LoadedEnv,
    verifiers: VerifiersEnvironment | None = None,
    index: int = 0,
) -> int:
    """The prompts of each eval of `loaded`: `eval.num_examples`, at most its rows (or
    a verifiers env's tasks)."""
    if verifiers is not None:
        return _verifiers_eval_examples(config, f"eval.env[{index}]", verifiers)
    wanted = config.eval.num_examples
    if loaded.dataset is None:
        return wanted  # a plugin: the config requires a count
    rows = len(loaded.dataset)
    return rows if wanted < 0 else max(1, min(wanted, rows))


def _environment(
    config: Config,
    loaded: LoadedEnv,
    tokenizer: ChatTokenizer,
    pool: RewardExecutor,
    verifiers: VerifiersEnvironment | None = None,
) -> Environment:
    env = loaded.config
    if verifiers is not None:
        return verifiers
    budget = config.batch.max_seq_len - env.max_tokens
    if loaded.plugin is not None:
        return PluginEnvironment(
            name=env.name,
            plugin=loaded.plugin,
            tokenizer=tokenizer,
            sampling=_sampling(env, tokenizer.stop_token_ids, max_turns=env.max_turns),
            rewards=loaded.rewards,
            pool=pool,
            budget=budget,
            timeout_s=config.rewards.timeout_s,
        )
    assert loaded.dataset is not None
    return DatasetEnvironment(
        name=env.name,
        dataset=loaded.dataset,
        order=DataOrder(len(loaded.dataset), config.seed, env.name),
        columns=PromptColumns(
            prompt=env.prompt,
            messages=env.messages,
            system_prompt=env.system_prompt,
            answer=env.answer,
        ),
        tokenizer=tokenizer,
        rewards=loaded.rewards,
        pool=pool,
        sampling=_sampling(env, tokenizer.stop_token_ids, max_turns=1),
        budget=budget,
    )


def _sampling(env: EnvConfig, stop_token_ids: tuple[int, ...], *, max_turns: int) -> Sampling:
    """The env's sampling keys, with the model's end-of-generation tokens."""
    return Sampling(
        max_tokens=env.max_tokens,
        temperature=env.temperature,
        top_p=env.top_p,
        top_k=env.top_k,
        stop_token_ids=stop_token_ids,
        max_turns=max_turns,
    )

"""Reward functions named by "module:function" import paths: loading, checking and scoring.

Pure logic, importable in any process: the reward pool's worker processes import this
module (and the user's reward modules) and nothing else of the daemon.

The contract: a reward function takes the keyword arguments it names among
`REWARD_ARGUMENTS` (or all of them through `**kwargs`) and returns a real, finite number.
A rollout's score is the weighted sum of its environment's reward functions.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import numbers
import os
import signal
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs

from orchestrator.errors import UserError

# The keyword arguments a reward function may take: the prompt messages, the final
# completion's text, the whole conversation as messages, the dataset's answer (or None),
# the dataset row as a dict, and the environment's name.
REWARD_ARGUMENTS = ("prompt", "completion", "messages", "answer", "info", "env")

_NAMED_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class RewardConfigError(UserError):
    """A reward function's import path does not name a usable reward function."""


class RewardValueError(ValueError):
    """A reward function returned something that is not a real, finite number."""


def _finite_weight(_instance: object, _attribute: object, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"weight {value!r} is not finite")


@attrs.frozen
class RewardSpec:
    """One reward function of an environment: where it is, its weight in the sum, and the
    keyword arguments it takes (all of `REWARD_ARGUMENTS` when it has `**kwargs`)."""

    path: str
    weight: float = attrs.field(validator=_finite_weight)
    keywords: tuple[str, ...]


FailureKind = Literal["raised", "bad_value"]


@attrs.frozen
class ScoreOutcome:
    """What `score_rollout_captured` hands back across the process boundary: the score,
    or the kind of failure with a one-line detail and the traceback text."""

    score: float | None
    failure: FailureKind | None = None
    detail: str = ""
    traceback: str = ""


def _one_line(exc: BaseException) -> str:
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def _split_path(path: str, what: str) -> tuple[str, str]:
    module_name, colon, attribute = path.partition(":")
    if not colon or ":" in attribute or not module_name or not attribute:
        raise RewardConfigError(
            f"{what} {path!r}: write it as 'module:function' (one ':', both parts)"
        )
    return module_name, attribute


def _import_function(path: str) -> Callable[..., Any]:
    return import_callable(path, "reward function")


@functools.cache
def import_callable(path: str, what: str) -> Callable[..., Any]:
    """The function a "module:function" `path` names (`what` it is, for the messages:
    "reward function", "factory"). Raises `RewardConfigError`, one line.

    Cached per process: a worker imports and looks up each function once. Failures raise
    and are not cached, so a module fixed on disk is picked up by the next call."""
    module_name, attribute = _split_path(path, what)
    try:
        module = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:
        raise RewardConfigError(
            f"{what} {path!r}: module {module_name!r} does not import: {_one_line(exc)}"
        ) from exc
    found: object = module
    for name in attribute.split("."):
        try:
            found = getattr(found, name)
        except AttributeError:
            raise RewardConfigError(
                f"{what} {path!r}: module {module_name!r} has no {attribute!r}"
            ) from None
    if not callable(found):
        raise RewardConfigError(
            f"{what} {path!r}: {attribute!r} is a {type(found).__name__}, not a function"
        )
    return found


def _keywords(path: str, function: Callable[..., Any]) -> tuple[str, ...]:
    if inspect.iscoroutinefunction(function):
        raise RewardConfigError(
            f"reward function {path!r} is async: reward functions are plain functions"
        )
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError) as exc:
        raise RewardConfigError(
            f"reward function {path!r}: its signature cannot be read: {_one_line(exc)}"
        ) from exc
    takes: set[str] = set()
    for parameter in signature.parameters.values():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            return REWARD_ARGUMENTS
        named = parameter.kind in _NAMED_KINDS and parameter.name in REWARD_ARGUMENTS
        if named:
            takes.add(parameter.name)
        elif parameter.default is inspect.Parameter.empty and parameter.kind in (
            *_NAMED_KINDS,
            inspect.Parameter.POSITIONAL_ONLY,
        ):
            raise RewardConfigError(
                f"reward function {path!r} requires {parameter.name!r}, which is not one of "
                f"the arguments it can be given ({', '.join(REWARD_ARGUMENTS)}) by keyword"
            )
    return tuple(name for name in REWARD_ARGUMENTS if name in takes)


def load_reward(path: str, weight: float) -> RewardSpec:
    """Import the reward function at `path` ("module:function") and check its signature.

    Raises `RewardConfigError` (one line) when the path is not "module:function", the
    module does not import, it has no such attribute, the attribute is not callable or is
    async, or the function requires a parameter other than `REWARD_ARGUMENTS`; and when
    the weight is not a finite number.
    """
    function = _import_function(path)
    try:
        return RewardSpec(path=path, weight=float(weight), keywords=_keywords(path, function))
    except ValueError as exc:
        raise RewardConfigError(f"reward function {path!r}: {exc}") from None


def _as_score(spec: RewardSpec, value: object) -> float:
    # bool is an int subclass, but True is no reward; numpy's scalars are numbers.Real.
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise RewardValueError(
            f"reward function {spec.path!r} returned {value!r} "
            f"({type(value).__name__}), not a number"
        )
    try:
        score = float(value)
    except (OverflowError, ValueError) as exc:
        raise RewardValueError(
            f"reward function {spec.path!r} returned {value!r}, not a float: {exc}"
        ) from exc
    if not math.isfinite(score):
        raise RewardValueError(f"reward function {spec.path!r} returned {score!r}, not finite")
    return score


def score_rollout(specs: Sequence[RewardSpec], arguments: Mapping[str, Any]) -> float:
    """The weighted sum of the reward functions' values for one rollout.

    `arguments` holds the values of `REWARD_ARGUMENTS` by name; each function is called
    with only the ones it takes. Raises whatever a function raises, `RewardConfigError`
    when a function cannot be imported here, and `RewardValueError` when one returns
    something that is not a real, finite number (a bool is not a number here).
    """
    total = 0.0
    for spec in specs:
        function = _import_function(spec.path)
        value = function(**{name: arguments[name] for name in spec.keywords})
        total += spec.weight * _as_score(spec, value)
    if not math.isfinite(total):
        paths = ", ".join(spec.path for spec in specs)
        raise RewardValueError(f"the weighted sum of {paths} is {total!r}, not finite")
    return total


def import_reward_functions(paths: Iterable[str]) -> None:
    """Import the reward functions at `paths` into this process's cache, skipping any that
    fail: scoring with them reports the failure. A worker process's start-up hook.

    A reward function may carry a `prepare` attribute, a callable taking no arguments that
    does its heavy start-up work (importing a large library, loading a model): it is called
    here, in the worker, and never in the daemon, which only checks that the function
    exists. An exception from it is left for the first call to meet again."""
    for path in paths:
        try:
            prepare = getattr(_import_function(path), "prepare", None)
        except RewardConfigError:
            continue
        if callable(prepare):
            try:
                prepare()
            except Exception:
                pass


def prepare_rewards(paths: Iterable[str]) -> list[tuple[str, str]]:
    """Import the reward functions at `paths` and call each one's `prepare`, as a worker
    starts (`import_reward_functions`), but saying what failed: a (path, one line) for
    each function that does not import here or whose `prepare` raised. `check-config`
    runs it in a reward worker."""
    failures: list[tuple[str, str]] = []
    for path in paths:
        try:
            prepare = getattr(_import_function(path), "prepare", None)
        except RewardConfigError as exc:
            failures.append((path, str(exc)))
            continue
        if callable(prepare):
            try:
                prepare()
            except KeyboardInterrupt:
                raise
            except BaseException as exc:
                failures.append((path, f"its prepare() raised {_one_line(exc)}"))
    return failures


#: How much nicer than the daemon its reward workers run (see `start_reward_worker`).
REWARD_WORKER_NICENESS = 5


def start_reward_worker(paths: Iterable[str]) -> None:
    """A reward worker process's start-up: deaf to the stop signals, below the daemon in
    the scheduler's eyes, then the reward functions at `paths` imported
    (`import_reward_functions`). It lives here, beside what a worker runs, so that a
    worker imports this light module and the reward modules, not the pool's.

    The daemon stops its workers itself (trio-parallel kills one with SIGKILL when it
    must): SIGTERM or SIGINT sent to the whole process group (systemd's stop, `timeout`,
    Ctrl-C in a terminal) would otherwise kill them under the daemon's graceful stop, whose
    scoring still needs them. Rewards are throughput work and the event loop is the
    latency that keeps the servers fed: where both want the same cores, the loop goes
    first. (Without contention a niceness changes nothing.)"""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.nice(REWARD_WORKER_NICENESS)
    import_reward_functions(paths)


def score_rollout_captured(
    specs: Sequence[RewardSpec], arguments: Mapping[str, Any]
) -> ScoreOutcome:
    """`score_rollout`, with every failure caught and described in plain strings.

    This is what a worker process runs: the outcome always pickles (a user's exception
    type might not), and carries the traceback text formatted where it happened.
    """
    try:
        return ScoreOutcome(score=score_rollout(specs, arguments))
    except RewardValueError as exc:
        return ScoreOutcome(None, "bad_value", str(exc), traceback.format_exc())
    except KeyboardInterrupt:
        raise
    # BaseException too: a reward calling sys.exit() (or math-verify's TimeoutException,
    # a BaseException) must not end the worker.
    except BaseException as exc:
        return ScoreOutcome(None, "raised", _one_line(exc), traceback.format_exc())


def score_rollouts_captured(
    calls: Sequence[tuple[Sequence[RewardSpec], Mapping[str, Any]]],
) -> list[ScoreOutcome]:
    """`score_rollout_captured` for each (specs, arguments) of `calls`, in order: the job a
    worker process runs for a batch of rollouts, one outcome each."""
    return [score_rollout_captured(specs, arguments) for specs, arguments in calls]

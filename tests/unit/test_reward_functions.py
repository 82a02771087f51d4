"""Reward functions by import path: loading and its errors, the weighted sum, which
arguments each function gets, the checks on what it returns, and the built-in rewards."""

from __future__ import annotations

import math
import textwrap
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from orchestrator import rewards
from orchestrator.errors import UserError
from orchestrator.tasks.reward_functions import (
    REWARD_ARGUMENTS,
    RewardConfigError,
    RewardSpec,
    RewardValueError,
    load_reward,
    score_rollout,
    score_rollout_captured,
)

WriteModule = Callable[[str], str]

ARGUMENTS: dict[str, Any] = {
    "prompt": [{"role": "user", "content": "What is 1 + 2?"}],
    "completion": " 3 ",
    "messages": [
        {"role": "user", "content": "What is 1 + 2?"},
        {"role": "assistant", "content": " 3 "},
    ],
    "answer": "3",
    "info": {"question": "What is 1 + 2?", "answer": "3"},
    "env": "arithmetic",
}


@pytest.fixture
def write_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> WriteModule:
    """`write_module(source)` writes a module with a fresh name into a folder on
    `sys.path` and returns the name: every test imports its own."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(source: str) -> str:
        name = f"user_rewards_{uuid.uuid4().hex[:12]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        return name

    return write


def test_weighted_sum_gives_each_function_only_what_it_names(write_module: WriteModule) -> None:
    module = write_module(
        """
        seen = {}

        def correct(completion, answer):
            seen["correct"] = (completion, answer)
            return 1.0 if completion.strip() == answer else 0.0

        def short(completion, *, env, unused="default"):
            seen["short"] = (completion, env, unused)
            return 1.0 / len(completion)

        def everything(**kwargs):
            seen["everything"] = sorted(kwargs)
            return 2
        """
    )
    specs = [
        load_reward(f"{module}:correct", 1.0),
        load_reward(f"{module}:short", -0.5),
        load_reward(f"{module}:everything", 0.25),
    ]
    assert [spec.keywords for spec in specs] == [
        ("completion", "answer"),
        ("completion", "env"),
        REWARD_ARGUMENTS,
    ]
    assert score_rollout(specs, ARGUMENTS) == pytest.approx(1.0 - 0.5 / 3 + 0.5)
    seen = __import__(module).seen
    assert seen["correct"] == (" 3 ", "3")
    assert seen["short"] == (" 3 ", "arithmetic", "default")
    assert seen["everything"] == sorted(REWARD_ARGUMENTS)


def test_no_functions_score_zero() -> None:
    assert score_rollout([], ARGUMENTS) == 0.0


def test_numpy_scalars_and_ints_are_numbers(write_module: WriteModule) -> None:
    module = write_module(
        """
        import numpy as np

        def half():
            return np.float32(0.5)

        def one():
            return np.int64(1)

        def two():
            return 2
        """
    )
    specs = [load_reward(f"{module}:{name}", 1.0) for name in ("half", "one", "two")]
    total = score_rollout(specs, ARGUMENTS)
    assert total == 3.5
    assert type(total) is float


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        ("True", r":flag' returned True \(bool\), not a number"),
        ("'1.0'", r":flag' returned '1.0' \(str\), not a number"),
        ("None", r":flag' returned None \(NoneType\), not a number"),
        ("np.bool_(True)", r":flag' returned .*True_? \(bool_?\), not a number"),
        ("float('nan')", r":flag' returned nan, not finite"),
        ("-math.inf", r":flag' returned -inf, not finite"),
        ("np.float64('inf')", r":flag' returned inf, not finite"),
        ("10**400", r":flag' returned 1000.*, not a float"),
    ],
)
def test_a_value_that_is_not_a_finite_number_names_the_function(
    write_module: WriteModule, returned: str, message: str
) -> None:
    module = write_module(
        f"""
        import math
        import numpy as np

        def flag():
            return {returned}
        """
    )
    spec = load_reward(f"{module}:flag", 1.0)
    with pytest.raises(RewardValueError, match=rf"reward function '{module}{message}"):
        score_rollout([spec], ARGUMENTS)


def test_captured_outcomes_describe_failures_in_strings(write_module: WriteModule) -> None:
    module = write_module(
        """
        import sys

        def fine():
            return 0.5

        def broken(completion):
            raise KeyError(completion)

        def quits():
            sys.exit(3)

        def nan():
            return float("nan")
        """
    )

    def captured(name: str) -> Any:
        return score_rollout_captured([load_reward(f"{module}:{name}", 2.0)], ARGUMENTS)

    assert captured("fine").score == 1.0
    broken = captured("broken")
    assert (broken.score, broken.failure, broken.detail) == (None, "raised", "KeyError: ' 3 '")
    assert f"{module}.py" in broken.traceback
    assert "in broken" in broken.traceback
    quits = captured("quits")
    assert (quits.failure, quits.detail) == ("raised", "SystemExit: 3")
    nan = captured("nan")
    assert nan.failure == "bad_value"
    assert nan.detail == f"reward function '{module}:nan' returned nan, not finite"
    assert "RewardValueError" in nan.traceback


def test_functions_are_imported_once_per_process(write_module: WriteModule) -> None:
    module = write_module(
        """
        imports = []
        imports.append(1)

        def one():
            return 1.0
        """
    )
    spec = load_reward(f"{module}:one", 1.0)
    for _ in range(3):
        assert score_rollout([spec], ARGUMENTS) == 1.0
    assert __import__(module).imports == [1]


@pytest.mark.parametrize("path", ["no_colon", "a:b:c", ":function", "module:"])
def test_a_path_without_one_colon_is_refused(path: str) -> None:
    with pytest.raises(RewardConfigError) as raised:
        load_reward(path, 1.0)
    assert str(raised.value) == (
        f"reward function {path!r}: write it as 'module:function' (one ':', both parts)"
    )
    assert isinstance(raised.value, UserError)


def test_a_module_that_is_missing_is_refused() -> None:
    with pytest.raises(RewardConfigError) as raised:
        load_reward("no_such_reward_module_xyz:score", 1.0)
    assert str(raised.value) == (
        "reward function 'no_such_reward_module_xyz:score': module "
        "'no_such_reward_module_xyz' does not import: "
        "ModuleNotFoundError: No module named 'no_such_reward_module_xyz'"
    )


def test_a_module_that_fails_to_import_says_why_in_one_line(write_module: WriteModule) -> None:
    module = write_module(
        """
        raise RuntimeError("needs a GPU\\nand a second line")
        """
    )
    with pytest.raises(RewardConfigError) as raised:
        load_reward(f"{module}:score", 1.0)
    assert str(raised.value) == (
        f"reward function '{module}:score': module '{module}' does not import: "
        "RuntimeError: needs a GPU and a second line"
    )


def test_a_module_with_a_syntax_error_is_refused(write_module: WriteModule) -> None:
    module = write_module("def score(:\n")
    with pytest.raises(RewardConfigError, match=r"does not import: SyntaxError: ") as raised:
        load_reward(f"{module}:score", 1.0)
    assert "\n" not in str(raised.value)


def test_a_missing_attribute_is_refused(write_module: WriteModule) -> None:
    module = write_module("def score():\n    return 1.0\n")
    with pytest.raises(RewardConfigError) as raised:
        load_reward(f"{module}:scroe", 1.0)
    assert (
        str(raised.value) == f"reward function '{module}:scroe': module '{module}' has no 'scroe'"
    )


def test_something_not_callable_is_refused(write_module: WriteModule) -> None:
    module = write_module("score = 0.5\n")
    with pytest.raises(RewardConfigError) as raised:
        load_reward(f"{module}:score", 1.0)
    assert (
        str(raised.value) == f"reward function '{module}:score': 'score' is a float, not a function"
    )


def test_an_async_function_is_refused(write_module: WriteModule) -> None:
    module = write_module("async def score(completion):\n    return 1.0\n")
    with pytest.raises(RewardConfigError) as raised:
        load_reward(f"{module}:score", 1.0)
    assert str(raised.value) == (
        f"reward function '{module}:score' is async: reward functions are plain functions"
    )


@pytest.mark.parametrize(
    ("signature", "required"),
    [
        ("completion, reference", "reference"),
        ("*, completion, tokens", "tokens"),
        ("completion, /", "completion"),
    ],
)
def test_a_required_parameter_that_is_not_a_reward_argument_is_refused(
    write_module: WriteModule, signature: str, required: str
) -> None:
    module = write_module(f"def score({signature}):\n    return 1.0\n")
    with pytest.raises(RewardConfigError) as raised:
        load_reward(f"{module}:score", 1.0)
    assert str(raised.value) == (
        f"reward function '{module}:score' requires {required!r}, which is not one of the "
        "arguments it can be given (prompt, completion, messages, answer, info, env) by keyword"
    )


def test_optional_and_star_args_parameters_are_allowed(write_module: WriteModule) -> None:
    module = write_module("def score(*args, completion, scale=2.0):\n    return scale\n")
    spec = load_reward(f"{module}:score", 1.0)
    assert spec == RewardSpec(path=f"{module}:score", weight=1.0, keywords=("completion",))
    assert score_rollout([spec], ARGUMENTS) == 2.0


@pytest.mark.parametrize("weight", [math.nan, math.inf])
def test_a_weight_that_is_not_finite_is_refused(write_module: WriteModule, weight: float) -> None:
    module = write_module("def score():\n    return 1.0\n")
    with pytest.raises(RewardConfigError) as raised:
        load_reward(f"{module}:score", weight)
    assert str(raised.value) == f"reward function '{module}:score': weight {weight!r} is not finite"


def test_the_builtins_load_by_their_documented_paths() -> None:
    assert load_reward("orchestrator.rewards:exact_match", 1.0).keywords == (
        "completion",
        "answer",
    )
    assert load_reward("orchestrator.rewards:math_answer", 1.0).keywords == (
        "completion",
        "answer",
    )
    assert load_reward("orchestrator.rewards:number_format", 0.1).keywords == ("completion",)


@pytest.mark.parametrize(
    ("completion", "answer", "score"),
    [
        (" Paris\n", "Paris ", 1.0),
        ("paris", "Paris", 0.0),
        ("42", 42, 1.0),
        ("The answer is 42", "42", 0.0),
        ("anything", None, 0.0),
    ],
)
def test_exact_match(completion: str, answer: object, score: float) -> None:
    assert rewards.exact_match(completion=completion, answer=answer) == score


@pytest.mark.parametrize(
    ("completion", "answer", "score"),
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("The answer is 3", "3", 1.0),
        ("First 2, then 7, so \\boxed{5}.", "5", 1.0),
        ("So x = 4, and finally 5", "5", 1.0),
        ("So x = 4, and finally 5", "4", 0.0),
        ("so $\\sqrt{2}$", "$\\sqrt{2}$", 1.0),
        ("\\boxed{3}", 3, 1.0),
        ("\\boxed{4}", "3", 0.0),
        ("asdf qwerty", "3", 0.0),
        ("}}}\\boxed{\\frac{", "3", 0.0),
        ("", "3", 0.0),
        ("3", "", 0.0),
        ("3", None, 0.0),
    ],
)
def test_math_answer(completion: str, answer: object, score: float) -> None:
    assert rewards.math_answer(completion=completion, answer=answer) == score


def test_math_answer_works_outside_the_main_thread() -> None:
    # math-verify's signal-based timeouts raise ValueError outside a main thread; the
    # built-in turns them off there instead of scoring everything 0.
    scores: list[float] = []
    thread = threading.Thread(
        target=lambda: scores.append(rewards.math_answer("\\boxed{\\frac{1}{2}}", "0.5"))
    )
    thread.start()
    thread.join()
    assert scores == [1.0]


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("42", 1.0),
        (" -3\n", 1.0),
        ("+0.25", 1.0),
        (".5", 1.0),
        ("3.", 0.0),
        ("1e5", 0.0),
        ("1,000", 0.0),
        ("42 apples", 0.0),
        ("4 2", 0.0),
        ("", 0.0),
        ("٤٢", 0.0),
    ],
)
def test_number_format(completion: str, score: float) -> None:
    assert rewards.number_format(completion=completion) == score


def test_builtins_return_floats() -> None:
    values = [
        rewards.exact_match("a", "a"),
        rewards.math_answer("1", "1"),
        rewards.number_format("1"),
    ]
    assert [type(value) for value in values] == [float, float, float]
    assert np.isfinite(values).all()

"""`check-config` tries the user's code as the run would (issue 55, findings 2 and 4): each
reward's `prepare` in a reward worker, one row of each env scored by each reward alone,
a row without its answer skipped by row and column. Each problem is one line naming the
env, the reward and the exception's last line; what went well is in the report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_kit import refused, run_cli
from demo_run import DEMO_CONFIG, DEMO_DATA, demo_paths

pytestmark = pytest.mark.slow

REWARDS = """
def prepare():
    import no_such_reward_library  # the library the user forgot to install

def needs_library(completion):
    return 1.0

needs_library.prepare = prepare

def brittle(completion, info):
    return float(info["difficulty"])  # a key the rows do not have
"""


def args(tmp_path: Path, *more: str) -> list[str]:
    (tmp_path / "user_rewards_55.py").write_text(REWARDS)
    base = [*demo_paths(tmp_path / "run"), "rewards.workers=1", *more]
    return [str(DEMO_CONFIG), *(arg for item in base for arg in ("--set", item))]


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # "module:function" paths resolve against the directory the command runs in.
    monkeypatch.chdir(tmp_path)


def test_a_prepare_that_fails_in_the_worker_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(
        capsys,
        "check-config",
        *args(
            tmp_path,
            'env.1.rewards=["user_rewards_55:needs_library"]',
            "env.1.reward_weights=[1.0]",
        ),
    )
    assert err.startswith("orchestrator check-config: error: env[1].rewards[0]: reward "), err
    assert "user_rewards_55:needs_library" in err
    assert "ModuleNotFoundError: No module named 'no_such_reward_library'" in err


def test_a_reward_that_raises_on_a_row_is_one_line_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = refused(
        capsys,
        "check-config",
        *args(tmp_path, 'env.1.rewards=["user_rewards_55:brittle"]', "env.1.reward_weights=[1.0]"),
    )
    assert "env[1] chat: reward user_rewards_55:brittle failed on row " in err, err
    assert err.rstrip().endswith("KeyError: 'difficulty'"), err


def test_what_was_scored_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "check-config", *args(tmp_path))
    assert code == 0, err
    tried = [line for line in out.splitlines() if line.startswith("#   tried:")]
    assert len(tried) == 3, out
    assert "env[1] chat: row " in tried[1] and "orchestrator.rewards:exact_match = 1" in tried[1]


def test_rows_without_their_answer_are_skipped_by_row_and_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [json.loads(line) for line in (DEMO_DATA / "chat.jsonl").read_text().splitlines()]
    data = tmp_path / "no_answers.jsonl"
    # The first row has the column, null (JSON lines take their columns from it); the
    # others lack it.
    data.write_text(
        "\n".join(
            json.dumps({**row, "answer": None} if i == 0 else {"messages": row["messages"]})
            for i, row in enumerate(rows[:3])
        )
        + "\n"
    )
    err = refused(capsys, "check-config", *args(tmp_path, f'env.1.dataset="{data}"'))
    assert "env[1]: env chat: no row of" in err, err
    assert "column 'answer' has no value" in err and "(row " in err


GAME = """
class Game:
    def __init__(self, crash=False):
        self.crash = crash

    def prompt(self, index):
        messages = [{"role": "user", "content": f"Game {index}: your guess?"}]
        return messages, {"answer": str(index % 10)}

    def step(self, messages, info):
        if self.crash:
            raise RuntimeError("the game crashed")
        return None

    def score(self, messages, info):
        return float(info["answer"] in messages[-1]["content"])


def make_game(crash=False):
    return Game(crash)
"""


def test_a_plugin_plays_one_turn_and_is_scored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "games_55.py").write_text(GAME)
    env = 'env=[{name = "game", factory = "games_55:make_game", max_turns = 2}]'
    code, out, err = run_cli(capsys, "check-config", *args(tmp_path, env))
    assert code == 0, err
    assert "#   tried:        env[0] game: episode 0 scored, completion its answer: " in out
    assert "score() = 1" in out
    crashing = 'env=[{name = "game", factory = "games_55:make_game", args = {crash = true}}]'
    err = refused(capsys, "check-config", *args(tmp_path, crashing))
    assert "env[0] game: episode 0 failed: RuntimeError: the game crashed" in err, err

"""Progress or stop, replayed as real runs: `orchestrator run` on the demo's real tasks
and the local fleet, each run's rewards one of three a user met, with a stop time of a
second. Rollouts finish and none is trainable, so each run stops by itself: exit status
2, the summary, then one line naming why, its count, an example and what to try.

- a reward the random tokens never earn (every group all 0): no signal, at the bottom;
- a reward that raises for every rollout (a module it needs is missing): reward_failed;
- a reward every rollout earns in full (every group all at the top): the task is solved.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from cli_kit import config_args, run_cli
from demo_run import DEMO_CONFIG, DEMO_DATA, demo_paths

FIXTURES = Path(__file__).resolve().parent

CASES = {
    "no signal": (
        "zero",
        "orchestrator run: error: nothing trainable for ",
        "were discarded as no_signal, every group's rewards all 0 (the bottom, "
        "batch.curriculum_min_mean_reward): the model never earned a reward; ",
    ),
    "every reward failing": (
        "raises",
        "orchestrator run: error: nothing trainable for ",
        "were discarded as reward_failed, most often raised: ValueError: cannot score ",
    ),
    "solved": (
        "trivial",
        "orchestrator run: stopped: the task is solved: for ",
        "every group's rewards were all at the top (1, batch.curriculum_max_mean_reward)",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_run_with_nothing_trainable_stops_with_one_line(
    case: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reward, start, middle = CASES[case]
    # The reward workers are spawned with the daemon's sys.path: they find the module.
    monkeypatch.syspath_prepend(str(FIXTURES))
    env = (
        f'[{{name = "arith", dataset = "{DEMO_DATA / "arith.jsonl"}", prompt = "question", '
        f'answer = "answer", rewards = ["reward_fixtures:{reward}"], max_tokens = 8}}]'
    )
    overrides = [
        *demo_paths(tmp_path / "run"),
        "max_steps=0",
        f"env={env}",
        "eval.env=[]",
        "rewards.workers=1",
        "batch.curriculum_max_mean_reward=1.0",
        "progress.no_progress_stop_s=1.0",
    ]
    code, _, err = run_cli(capsys, "run", *config_args(DEMO_CONFIG, *overrides))
    assert code == 2, err[-3000:]
    # (The log's `reward failed` line carries the reward's own traceback, as a field.)
    assert not [line for line in err.splitlines() if "Traceback" in line and line[:1] != "{"]
    last = err.rstrip("\n").splitlines()[-1]
    assert last.startswith(start) and middle in last, last
    assert "Try: " in last
    assert "stopped        by " in err and "== run summary ==" in err
    # Nothing shipped, the payload files of what was discarded were deleted at once.
    assert "steps          0 " in err
    if case != "every reward failing":
        assert "of payload files written and deleted for them" in last, last
        (payload,) = [line for line in err.splitlines() if line.startswith("payload ")]
        assert re.search(r"\(discard \d+ / \d", payload), payload

"""Real tasks end to end, in-process against the local fleet: prompts rendered from the
user's dataset with the model's chat template and stop tokens, completions decoded and
scored by reward functions in worker processes, the env's name in every shipped sample; a
reward that raises, hangs or kills its worker discards its rollout as `reward_failed` and
the run goes on; a resumed run continues the data instead of replaying it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
import trio
from demo_run import DEMO_DATA, DEMO_MODEL, small_demo_config

from orchestrator.commands.launch import launch_run
from orchestrator.config import Config
from orchestrator.daemon import RunOutcome
from orchestrator.handoff import BATCH_FILE, read_batch_file, shipped_steps
from orchestrator.logs import console_processors
from orchestrator.tasks.chat import ChatTokenizer

ARITH = DEMO_DATA / "arith.jsonl"

pytestmark = pytest.mark.slow


def rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def on_console(entry: dict[str, Any]) -> str | None:
    """A captured event as the console shows it on a terminal (None: left out)."""
    rendered: Any = {**entry, "level": entry["log_level"], "timestamp": "00:00:00"}
    del rendered["log_level"]
    for processor in console_processors(colors=False):
        try:
            rendered = processor(None, entry["log_level"], rendered)
        except structlog.DropEvent:
            return None
    assert isinstance(rendered, str)
    return rendered.removeprefix("00:00:00 ")


def shipped_samples(config: Config) -> list[object]:
    return [
        sample
        for step in shipped_steps(config.batches_dir)
        for sample in read_batch_file(config.batches_dir / f"step_{step:06d}" / BATCH_FILE).samples
    ]


async def test_a_demo_run_trains_on_the_rendered_dataset_rows(tmp_path: Path) -> None:
    config = small_demo_config(tmp_path / "run", "max_steps=3")
    with structlog.testing.capture_logs() as logs, trio.fail_after(120):
        outcome: RunOutcome = await launch_run(config)
    # The tokenizer's load (transformers' import: seconds) is logged before and after,
    # the daemon's first lines; the run's start comes after.
    events = [entry["event"] for entry in logs]
    assert events[:2] == ["loading tokenizer", "tokenizer loaded"], events[:5]
    assert logs[0]["envs"] == ["arith", "chat"] and logs[1]["vocab_size"] == 1024
    assert events.index("fresh run") > 1
    assert shipped_steps(config.batches_dir) == [1, 2, 3]
    tokenizer = ChatTokenizer.load(DEMO_MODEL, require_chat_template=True)
    arith = rows(ARITH)
    samples = shipped_samples(config)
    assert {s.env for s in samples} <= {"arith", "chat"} and samples
    for sample in samples:
        assert sample.temperature == 1.0
        if sample.env != "arith":
            continue
        # The prompt is the row's question after the system prompt, rendered with the
        # chat template (generation prompt added): the sample starts with exactly it.
        row_index = int(sample.group_id.rsplit("-r", 1)[1])
        messages = [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": arith[row_index]["question"]},
        ]
        prompt = tokenizer.render_prompt(messages)
        assert sample.token_ids[: len(prompt)].tolist() == prompt.tolist()
        completion = sample.token_ids[len(prompt) :]
        assert 1 <= len(completion) <= 16 and sample.loss_mask[len(prompt) :].all()
        # A completion that stopped early ends with a stop token of the model.
        if len(completion) < 16:
            assert int(completion[-1]) in tokenizer.stop_token_ids
    # Rewards came from the reward functions, per env, in the sink's tally.
    tally = outcome.sink.by_env
    assert set(tally) == {"arith", "chat"}
    assert all(t.scored > 0 and t.mean_reward is not None for t in tally.values())
    assert sum(t.shipped for t in tally.values()) == 3 * config.batch.size
    assert outcome.state.dispatch.rollouts["reward_failed"] == 0
    # On a terminal: one line per shipped step and one per applied version naming both
    # servers (none per server), no zero discards, no absolute paths.
    shown = [line for entry in logs if (line := on_console(entry)) is not None]
    servers = ", ".join(url.removeprefix("http://") for url in outcome.urls)
    for step in (1, 2, 3):
        assert sum(line.startswith(f"[info] step {step} shipped: ") for line in shown) == 1
        assert f"[info] v{step} applied on {servers}; collection bound " in "\n".join(shown)
    assert not any("weights updated" in line for line in shown), shown
    zero_discard = re.compile(r"(stale|swept|no_signal|curriculum|untrainable|pruned|failed) 0\b")
    for line in (line for line in shown if " shipped: " in line):
        assert str(tmp_path) not in line and not zero_discard.search(line), line
    assert events.count("weights updated") == 3 * len(outcome.urls)


# Each way to fail is a role that the first prompt (answer) to come along takes, marked by a
# file next to the module: that prompt's rewards raise, return nan, hang once or kill their
# worker once. A hang and a death cost a worker's restart each, and more would only repeat
# what the first ones show. Calls go to a worker in batches, and a batch that hangs or
# kills its worker is scored again call by call, which the run's end may cut short: so a
# hang or a death is taken only once the daemon has reported the first two kinds (the test
# marks that with a file, `REPORTED`), and every kind is reported whatever the batches.
REPORTED = "reported"
FLAKY_REWARDS = f"""
import os, tempfile, time
from pathlib import Path

HERE = Path(__file__).parent

def role_of(answer):
    for role in ("raised", "bad_value", "hang", "exit"):
        if role in ("hang", "exit") and not (HERE / "{REPORTED}").exists():
            return None
        if take(role, answer) == answer:
            return role
    return None

def take(role, answer):
    # Whoever links first takes the role; the file holds its answer from the start.
    fd, scratch = tempfile.mkstemp(dir=HERE)
    os.write(fd, answer.encode())
    os.close(fd)
    try:
        os.link(scratch, HERE / role)
    except FileExistsError:
        pass
    finally:
        os.unlink(scratch)
    return (HERE / role).read_text()

def first_time(kind):
    try:
        os.close(os.open(HERE / (kind + ".done"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True

def hold_while_hung():
    # The run may not finish before the hung call's timeout (1 s) is seen: every other
    # call waits until 1.5 s after the hang began (a fast run once ended first).
    try:
        began = os.stat(HERE / "hang.done").st_mtime
    except FileNotFoundError:
        return
    time.sleep(max(0.0, began + 1.5 - time.time()))

def flaky(answer, completion):
    hold_while_hung()
    role = role_of(str(answer))
    if role == "raised":
        raise RuntimeError("this reward has a bug")
    if role == "bad_value":
        return float("nan")
    if role == "hang" and first_time("hang"):
        time.sleep(3600)
    if role == "exit" and first_time("exit"):
        os._exit(1)
    return len(completion) % 3 / 2
"""


async def mark_once_reported(logs: list[dict[str, Any]], kinds: set[str], marker: Path) -> None:
    """Create `marker` once "reward failed" has been logged for each of `kinds`."""
    # The captured logs are a plain list: polled, there is nothing to wait on.
    while not kinds <= {e.get("kind") for e in logs if e["event"] == "reward failed"}:  # noqa: ASYNC110
        await trio.sleep(0.005)
    await trio.Path(marker).touch()


async def test_rewards_that_raise_hang_or_kill_their_worker_discard_only_their_rollouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "flaky_rewards.py").write_text(FLAKY_REWARDS)
    # "module:function" paths resolve in the directory the run starts in.
    monkeypatch.chdir(tmp_path)
    config = small_demo_config(
        tmp_path / "run",
        "max_steps=3",
        f'env=[{{name = "arith", dataset = "{ARITH}", prompt = "question", answer = "answer", '
        'rewards = ["flaky_rewards:flaky"], max_tokens = 16}]',
        "rewards.timeout_s=1.0",
    )
    with structlog.testing.capture_logs() as logs, trio.fail_after(180):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                mark_once_reported, logs, {"raised", "bad_value"}, tmp_path / REPORTED
            )
            outcome = await launch_run(config)
            nursery.cancel_scope.cancel()
    assert shipped_steps(config.batches_dir) == [1, 2, 3]
    # Counted when scored; discarded when the sink takes the group (groups still in flight
    # at the end are stopped, never admitted).
    failed = outcome.state.dispatch.rollouts["reward_failed"]
    assert 0 < outcome.sink.counters["reward_failed"] <= failed
    failures = [entry for entry in logs if entry["event"] == "reward failed"]
    kinds = {entry["kind"] for entry in failures}
    assert kinds == {"raised", "timeout", "worker_died", "bad_value"}
    assert (tmp_path / "hang.done").exists() and (tmp_path / "exit.done").exists()
    # Once per (env, kind), with the traceback of a function that raised.
    assert len(failures) == len({(entry["env"], entry["kind"]) for entry in failures})
    raised = next(entry for entry in failures if entry["kind"] == "raised")
    assert "this reward has a bug" in str(raised)
    # Every shipped sample's reward came from a call that worked.
    assert all(s.env == "arith" for s in shipped_samples(config))


def prompts_of(config: Config, steps: list[int]) -> set[str]:
    """The prompt ids (`<env>-e<epoch>-r<row>`) of the groups shipped in `steps`."""
    return {
        sample.group_id.split("-", 1)[1]
        for step in steps
        for sample in read_batch_file(config.batches_dir / f"step_{step:06d}" / BATCH_FILE).samples
    }


async def test_a_resumed_run_continues_the_data(tmp_path: Path) -> None:
    config = small_demo_config(tmp_path / "run", "max_steps=2")
    with trio.fail_after(120):
        await launch_run(config)
    drawn = json.loads((config.state_dir / "progress.json").read_text())["prompts_drawn"]
    assert drawn > 0
    resumed = small_demo_config(tmp_path / "run", "max_steps=4")
    with trio.fail_after(120):
        outcome = await launch_run(resumed)
    assert outcome.first_step == 3
    assert shipped_steps(resumed.batches_dir) == [1, 2, 3, 4]
    # Batches 3 and 4 hold rows the first run never trained on (the demo's data is far
    # from an epoch): the resumed run went on with the data order, it did not replay it.
    before, after = prompts_of(resumed, [1, 2]), prompts_of(resumed, [3, 4])
    assert before and after and not before & after
    assert outcome.state.dispatch.prompts_drawn > drawn


GAME = '''
class Game:
    """Guess the number: the user answers each guess until `turns` replies were given."""

    def __init__(self, turns, fail_every=0):
        self.turns = turns
        self.fail_every = fail_every

    def prompt(self, index):
        messages = [
            {"role": "system", "content": "Guess the number."},
            {"role": "user", "content": f"Game {index}: your guess?"},
        ]
        return messages, {"answer": str(index % 10), "index": index}

    def step(self, messages, info):
        replies = sum(1 for m in messages if m["role"] == "assistant")
        if self.fail_every and info["index"] % self.fail_every == 0 and replies == 2:
            raise RuntimeError("the game crashed")
        if replies >= self.turns:
            return None
        return [{"role": "user", "content": "Wrong, try again."}]

    def score(self, messages, info):
        replies = [m["content"] for m in messages if m["role"] == "assistant"]
        hits = sum(info["answer"] in reply for reply in replies)
        return hits / len(replies) + len(replies[-1]) % 2


def make_game(turns=3, fail_every=0):
    return Game(turns, fail_every)
'''


async def test_a_plugin_environment_plays_multi_turn_episodes_bridged_onto_sampled_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "games.py").write_text(GAME)
    monkeypatch.chdir(tmp_path)
    config = small_demo_config(
        tmp_path / "run",
        "max_steps=3",
        'env=[{name = "game", factory = "games:make_game", args = {turns = 3, fail_every = 4},'
        " max_turns = 3, max_tokens = 12}]",
    )
    with trio.fail_after(180):
        outcome = await launch_run(config)
    assert shipped_steps(config.batches_dir) == [1, 2, 3]
    tokenizer = ChatTokenizer.load(DEMO_MODEL, require_chat_template=True)
    samples = shipped_samples(config)
    assert samples and {s.env for s in samples} == {"game"}
    multi_turn = 0
    for sample in samples:
        index = int(sample.group_id.rsplit("-", 1)[1])
        first = tokenizer.render_prompt(
            [
                {"role": "system", "content": "Guess the number."},
                {"role": "user", "content": f"Game {index}: your guess?"},
            ]
        )
        tokens, trained = sample.token_ids.tolist(), sample.loss_mask.tolist()
        assert tokens[: len(first)] == first.tolist()
        # After the first completion: the environment's turns (not trained), each the
        # bridged "Wrong, try again." user message, between the trained completions.
        spans, start = [], len(first)
        for position in range(len(first), len(tokens) + 1):
            if position == len(tokens) or trained[position] != trained[start]:
                spans.append((trained[start], tokens[start:position]))
                start = position
        environment = [ids for is_trained, ids in spans if not is_trained]
        assert all("Wrong, try again." in tokenizer.tokenizer.decode(ids) for ids in environment)
        assert len(environment) <= 2
        multi_turn += bool(environment)
    assert multi_turn > 0
    # The episodes whose game crashed failed alone; the run went on.
    assert outcome.state.dispatch.failures["environment"] > 0

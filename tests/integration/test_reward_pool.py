"""The reward pool with real worker processes: scores, the concurrency limit, and every
kind of failure (raised, timeout, worker_died, bad_value), each reported, logged once with
its traceback, counted, and survived.

The workers import the test reward functions from `reward_fixtures.py` beside this file.
The tests run with `--import-mode=importlib`, which puts no test folder on `sys.path`, so
the `fixtures_on_path` fixture puts this folder there before a pool opens: spawned
workers start with the parent's `sys.path`, as a user's reward folder reaches them.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import trio
from structlog.testing import capture_logs

from orchestrator.tasks.reward_functions import REWARD_WORKER_NICENESS, RewardSpec, load_reward
from orchestrator.tasks.reward_pool import RewardFailed, RewardPool, open_reward_pool

FIXTURES = Path(__file__).resolve().parent

ARGUMENTS: dict[str, Any] = {
    "prompt": [{"role": "user", "content": "Name a capital."}],
    "completion": "Paris",
    "messages": [
        {"role": "user", "content": "Name a capital."},
        {"role": "assistant", "content": "Paris"},
    ],
    "answer": "capitals",
    "info": {"question": "Name a capital.", "answer": "capitals"},
    "env": "capitals",
}


@pytest.fixture
def fixtures_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(FIXTURES))


def fixture(name: str, weight: float = 1.0) -> RewardSpec:
    return load_reward(f"reward_fixtures:{name}", weight)


@pytest.mark.usefixtures("fixtures_on_path")
async def test_scores_weighted_sums_in_workers_that_import_no_daemon() -> None:
    specs = [fixture("length", 0.5), fixture("answer_is_env", 2.0), fixture("numpy_half", -1.0)]
    prepared = [fixture("prepared")]
    async with open_reward_pool(2, 10.0, preload=[*specs, *prepared]) as pool:
        assert await pool.score("capitals", specs, ARGUMENTS) == 0.5 * 5 + 2.0 - 0.5
        other = {**ARGUMENTS, "env": "rivers", "completion": "Nile!"}
        assert await pool.score("rivers", specs, other) == 0.5 * 5 - 0.5
        assert await pool.score("capitals", [fixture("no_daemon_modules")], ARGUMENTS) == 1.0
        # Each worker ran the function's `prepare` once, when it started.
        assert await pool.score("capitals", prepared, ARGUMENTS) == 1.0

        # Four calls of 0.3 s on two workers: two rounds, never four at once.
        nap = [fixture("naps")]
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(pool.score, "capitals", nap, ARGUMENTS)
        assert trio.current_time() - start >= 0.6
        assert pool.failures == {}

        # Workers run nicer than the daemon: where both want a core, the loop goes first.
        own = await pool.score("capitals", [fixture("niceness")], ARGUMENTS)
        assert own == min(19, os.nice(0) + REWARD_WORKER_NICENESS)


@pytest.mark.usefixtures("fixtures_on_path")
async def test_a_pool_opened_with_start_starts_its_workers_before_any_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What `orchestrator run` does: the workers' spawn and imports go on while the
    # daemon loads its tokenizer, before anything asks for a score.
    folder = trio.Path(tmp_path)
    monkeypatch.setenv("REWARD_FIXTURES_ANNOUNCE", str(tmp_path))
    async with open_reward_pool(2, 10.0, preload=[fixture("announced")], start=True):
        deadline = time.monotonic() + 60
        while len(list(await folder.iterdir())) < 2:
            assert time.monotonic() < deadline, "the workers did not start"
            await trio.sleep(0.05)
    # Without `start`, a pool starts nothing until it is asked.
    for announcement in await folder.iterdir():
        await announcement.unlink()
    async with open_reward_pool(2, 10.0, preload=[fixture("announced")]) as pool:
        await trio.sleep(1.0)
        assert list(await folder.iterdir()) == []
        assert await pool.score("capitals", [fixture("announced")], ARGUMENTS) == 1.0


@pytest.mark.usefixtures("fixtures_on_path")
async def test_calls_made_together_go_to_the_free_workers_in_batches() -> None:
    sizes = [fixture("batch_size")]

    async def together(pool: RewardPool, count: int) -> list[float]:
        scores: list[float] = []

        async def one() -> None:
            scores.append(await pool.score("capitals", sizes, ARGUMENTS))

        async with trio.open_nursery() as nursery:
            for _ in range(count):
                nursery.start_soon(one)
        return sorted(scores)

    async with open_reward_pool(2, 10.0, preload=sizes) as pool:
        await pool.start_workers()
        # A group of four finishing at once: two workers free, two jobs of two.
        assert await together(pool, 4) == [2.0] * 4
        assert await together(pool, 3) == [1.0, 2.0, 2.0]
        assert await pool.score("capitals", sizes, ARGUMENTS) == 1.0
    async with open_reward_pool(1, 10.0, preload=sizes) as pool:
        assert await together(pool, 4) == [4.0] * 4


@pytest.mark.slow
@pytest.mark.usefixtures("fixtures_on_path")
@pytest.mark.parametrize(
    ("name", "kind"), [("exits", "worker_died"), ("hangs", "timeout"), ("raises", "raised")]
)
async def test_a_call_that_fails_its_batch_fails_alone(name: str, kind: str) -> None:
    failing, good, sizes = [fixture(name)], [fixture("length")], [fixture("batch_size")]
    async with open_reward_pool(1, 1.0, preload=[*failing, *good, *sizes]) as pool:
        results: dict[int, float | str] = {}

        async def one(index: int, specs: list[RewardSpec]) -> None:
            try:
                results[index] = await pool.score("capitals", specs, ARGUMENTS)
            except RewardFailed as exc:
                results[index] = exc.kind

        with capture_logs() as logs:
            async with trio.open_nursery() as nursery:
                for index in range(4):
                    nursery.start_soon(one, index, failing if index == 2 else good)
        assert results == {0: 5.0, 1: 5.0, 2: kind, 3: 5.0}
        assert pool.failures == {("capitals", kind): 1}
        # Reported once, by the batch's failure where there was one (not counted: its
        # calls were scored again), else by the call's own.
        reported = [entry for entry in logs if entry["event"] == "reward failed"]
        assert [entry["kind"] for entry in reported] == [kind]
        alone = [entry for entry in reported if "batch" in entry]
        # A raise is the call's own outcome: the batch stands. A death or a hang takes the
        # batch's job: its calls are scored again alone, and the env's calls stay alone.
        async with trio.open_nursery() as nursery:
            for index in range(2):
                nursery.start_soon(one, 10 + index, sizes)
        expected = 2.0 if kind == "raised" else 1.0
        assert (results[10], results[11]) == (expected, expected)
        assert len(alone) == (0 if kind == "raised" else 1), logs


@pytest.mark.slow
@pytest.mark.usefixtures("fixtures_on_path")
@pytest.mark.parametrize(
    ("name", "kind", "detail", "from_worker"),
    [
        ("raises", "raised", "ValueError: cannot score 'Paris'", "in raises"),
        ("hangs", "timeout", "no score within 1 s; worker killed", None),
        ("exits", "worker_died", "the worker process exited with code 1", None),
        (
            "nan",
            "bad_value",
            "reward function 'reward_fixtures:nan' returned nan, not finite",
            "nan",
        ),
        (
            "string",
            "bad_value",
            "reward function 'reward_fixtures:string' returned '1.0' (str), not a number",
            "RewardValueError",
        ),
    ],
)
async def test_a_failure_is_reported_logged_once_and_survived(
    name: str, kind: str, detail: str, from_worker: str | None
) -> None:
    failing, good = [fixture(name)], [fixture("length")]
    # One worker: the good call right after a kill or a death needs the replacement.
    async with open_reward_pool(1, 1.0, preload=[*failing, *good]) as pool:
        with capture_logs() as logs:
            for _ in range(2):
                with pytest.raises(RewardFailed) as raised:
                    await pool.score("capitals", failing, ARGUMENTS)
                assert (raised.value.kind, raised.value.detail) == (kind, detail)
                assert str(raised.value) == f"reward {kind}: {detail}"
                assert await pool.score("capitals", good, ARGUMENTS) == 5.0
        assert pool.failures == {("capitals", kind): 2}

    failed = [entry for entry in logs if entry["event"] == "reward failed"]
    assert len(failed) == 1, logs
    entry = failed[0]
    assert entry["log_level"] == "warning"
    assert (entry["env"], entry["kind"], entry["detail"]) == ("capitals", kind, detail)
    if from_worker is None:
        assert "traceback" not in entry
    else:
        # The traceback text was formatted in the worker: it ends in the fixture's frame.
        assert entry["traceback"].startswith("Traceback (most recent call last):")
        assert "reward_fixtures.py" in entry["traceback"] or kind == "bad_value"
        assert from_worker in entry["traceback"]


@pytest.mark.usefixtures("fixtures_on_path")
async def test_failures_are_counted_by_environment_and_logged_once_for_each() -> None:
    failing = [fixture("raises")]
    async with open_reward_pool(1, 10.0, preload=failing) as pool:
        with capture_logs() as logs:
            for env in ("capitals", "rivers", "capitals"):
                with pytest.raises(RewardFailed):
                    await pool.score(env, failing, ARGUMENTS)
        assert pool.failures == {("capitals", "raised"): 2, ("rivers", "raised"): 1}
    assert [(e["env"], e["kind"]) for e in logs if e["event"] == "reward failed"] == [
        ("capitals", "raised"),
        ("rivers", "raised"),
    ]


async def test_a_user_module_on_sys_path_imports_in_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A folder next to the user's config, put on sys.path (as PYTHONPATH would) before
    # the pool opens: not preloaded, so the worker imports it on its first call.
    folder = tmp_path / "my_rewards"
    folder.mkdir()
    (folder / "site_rewards.py").write_text(
        textwrap.dedent(
            """
            import sys

            def from_my_folder(completion, info):
                assert any(path.endswith("my_rewards") for path in sys.path)
                return float(completion == "Paris") + len(info)
            """
        )
    )
    monkeypatch.syspath_prepend(str(folder))
    spec = load_reward("site_rewards:from_my_folder", 1.0)
    async with open_reward_pool(1, 10.0) as pool:
        assert await pool.score("capitals", [spec], ARGUMENTS) == 3.0


@pytest.mark.usefixtures("fixtures_on_path")
async def test_the_builtins_score_in_workers() -> None:
    specs = [
        load_reward("orchestrator.rewards:math_answer", 1.0),
        load_reward("orchestrator.rewards:exact_match", 0.5),
        load_reward("orchestrator.rewards:number_format", 0.25),
    ]
    arguments = {**ARGUMENTS, "completion": "\\boxed{\\frac{1}{2}}", "answer": "0.5"}
    async with open_reward_pool(1, 30.0, preload=specs) as pool:
        assert await pool.score("math", specs, arguments) == 1.0
        plain = {**arguments, "completion": "0.5"}
        assert await pool.score("math", specs, plain) == 1.75
        assert await pool.score("math", specs, {**arguments, "completion": "no idea"}) == 0.0


@pytest.mark.usefixtures("fixtures_on_path")
async def test_per_call_overhead() -> None:
    # Not a benchmark: a floor that catches a pool gone badly wrong (e.g. a spawn per
    # call). Prints the rate, sequential and with two calls in flight per worker.
    trivial = [fixture("trivial")]
    async with open_reward_pool(2, 10.0, preload=trivial) as pool:
        calls = 200
        start = time.perf_counter()
        for _ in range(calls):
            await pool.score("bench", trivial, ARGUMENTS)
        sequential = calls / (time.perf_counter() - start)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(2 * calls):
                nursery.start_soon(pool.score, "bench", trivial, ARGUMENTS)
        concurrent = 2 * calls / (time.perf_counter() - start)
    print(
        f"reward pool, 2 workers, trivial reward: {sequential:.0f} calls/s one at a time, "
        f"{concurrent:.0f} calls/s concurrently",
        file=sys.stderr,
    )
    assert sequential > 50
    assert concurrent > 50


async def test_an_error_of_the_callers_leaves_the_pool_as_it_was_raised() -> None:
    # The pool's own nursery must not wrap it: the daemon's one-line errors go through.
    with pytest.raises(KeyError):
        async with open_reward_pool(1, 1.0):
            raise KeyError("the caller's")


@pytest.mark.usefixtures("fixtures_on_path")
async def test_workers_outlive_a_stop_signal_and_their_deaths_end_the_pool_quietly() -> None:
    # A SIGTERM for the whole process group reaches the workers too: the daemon stops
    # them itself, so they go on scoring. One killed from outside (the OOM killer) ends
    # the pool with a warning, not with trio-parallel's BrokenWorkerProcessError.
    pid = [fixture("pid")]
    with capture_logs() as logs:
        async with open_reward_pool(1, 10.0, preload=pid) as pool:
            worker = int(await pool.score("capitals", pid, ARGUMENTS))
            os.kill(worker, signal.SIGTERM)
            os.kill(worker, signal.SIGINT)
            await trio.sleep(0.2)
            assert await pool.score("capitals", pid, ARGUMENTS) == worker
            os.kill(worker, signal.SIGKILL)
            with trio.fail_after(10):
                while True:  # reaped by the pool's own shutdown below; wait for the death
                    try:
                        os.kill(worker, 0)
                    except ProcessLookupError:
                        break
                    if _is_zombie(worker):
                        break
                    await trio.sleep(0.05)
    warnings = [e for e in logs if e["log_level"] == "warning"]
    assert [e["event"] for e in warnings] == ["reward workers had died before the end of the run"]
    assert warnings[0]["workers"] == 1
    assert warnings[0]["detail"] == "one was killed by SIGKILL", warnings[0]
    assert "killed from outside" in warnings[0]["note"]


@pytest.mark.usefixtures("fixtures_on_path")
async def test_a_worker_its_reward_module_keeps_alive_is_killed_at_once_without_a_warning() -> None:
    # A library's thread that never ends keeps a worker's Python from exiting: the pool's
    # end kills it after its short grace rather than waiting (Ctrl-C once took 10 s more
    # for it, then warned as if the workers had been killed from outside).
    stuck = [fixture("keeps_a_thread")]
    with capture_logs() as logs:
        async with open_reward_pool(2, 10.0, preload=stuck, start=True) as pool:
            assert await pool.score("capitals", stuck, ARGUMENTS) == 1.0
            await pool.start_workers()
            closing = trio.current_time()
        # Both workers were alive when the pool closed (trio's clock is real time here).
        took = trio.current_time() - closing
    assert took < 5, took
    assert not [e for e in logs if e["log_level"] == "warning"], logs
    (killed,) = [e for e in logs if e["event"] == "reward workers killed at the end"]
    assert killed["workers"] == 2 and "a thread or a child process" in killed["detail"]


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return True

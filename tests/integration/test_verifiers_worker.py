"""The verifiers worker on the demo's environments (demo/verifiers_envs: written with
verifiers' own API, nothing of the orchestrator in them), against a stand-in for the
daemon's endpoint on loopback that samples fixed or right answers: `hello`, the tasks,
single- and multi-turn episodes (their rewards, metrics, and the completions the endpoint
sampled, call by call), what verifiers sends, an endpoint that fails, a worker killed in
the middle of an episode, and check-config's one-line refusals.

One worker per environment for the whole module (its start imports verifiers: seconds),
held open by a trio run in a thread (`TrioPortal`).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from fake_generate import FakeGenerate, open_fake_generate
from trio_portal import TrioPortal

from orchestrator.config import load_config
from orchestrator.core.environments import Driven, Sampling, ScoreFailed
from orchestrator.errors import UserError
from orchestrator.tasks.build import check_tasks
from orchestrator.tasks.chat import ChatTokenizer
from orchestrator.tasks.verifiers_env.environment import (
    VerifiersEnvironment,
    WorkerSpec,
    open_verifiers_environments,
)
from orchestrator.tasks.verifiers_env.protocol import INSTALL_LINE, WORKER_MODULE

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEMO_ENVS = REPO / "demo" / "verifiers_envs"
MODEL = REPO / "demo" / "model"
EOS = 2
QUESTION = re.compile(r"What is (-?\d+) ([-+*]) (-?\d+)\?")


@attrs.frozen
class Host:
    portal: TrioPortal
    fake: FakeGenerate
    arith: VerifiersEnvironment
    tokenizer: ChatTokenizer


def environment(name: str, ident: str, max_turns: int, args: Any = None) -> VerifiersEnvironment:
    spec = WorkerSpec(name, ident, MODEL, args=args or {}, max_turns=max_turns)
    sampling = Sampling(max_tokens=8, temperature=1.0, top_k=-1, max_turns=max_turns)
    return VerifiersEnvironment(spec, sampling, model="policy", seed=0)


def answering(tokenizer: ChatTokenizer) -> Any:
    """The endpoint's sampler: the right answer of the prompt's last question (then
    <|im_end|>) for rollouts named `right...`, "42" for the others."""

    def sample(rollout: str, prompt_ids: list[int], call: int) -> Sequence[int]:
        if not rollout.startswith("right"):
            return (478, EOS)
        a, op, b = QUESTION.findall(tokenizer.tokenizer.decode(prompt_ids))[-1]
        value = int(a) + int(b) if op == "+" else int(a) - int(b) if op == "-" else int(a) * int(b)
        return (*tokenizer.tokenizer.encode(str(value), add_special_tokens=False), EOS)

    return sample


@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    tokenizer = ChatTokenizer.load(MODEL)

    @asynccontextmanager
    async def open_host() -> AsyncIterator[tuple[FakeGenerate, VerifiersEnvironment]]:
        async with open_fake_generate(sample=answering(tokenizer)) as fake:
            arith = environment("arith", "vf-arith", 1, {"taskset": {"count": 12}})
            async with open_verifiers_environments([arith]):
                yield fake, arith

    with pytest.MonkeyPatch.context() as patch:
        # The worker's PYTHONPATH is this process's: the demo's packages importable.
        patch.setenv("PYTHONPATH", str(DEMO_ENVS))
        with TrioPortal() as portal:
            fake, arith = portal.enter(open_host)
            yield Host(portal, fake, arith, tokenizer)


@pytest.fixture(scope="module")
def twoturn(host: Host) -> Iterator[VerifiersEnvironment]:
    """vf-twoturn on the host's portal and endpoint: its own fixture, so that only the
    test process (xdist worker) that runs a test of it starts its worker (each start
    imports verifiers, seconds of CPU)."""

    @asynccontextmanager
    async def open_twoturn() -> AsyncIterator[VerifiersEnvironment]:
        env = environment("twoturn", "vf-twoturn", 2)
        async with open_verifiers_environments([env]):
            yield env

    # Started under the host's PYTHONPATH (its fixture holds it for the module), and
    # stopped with the host's portal.
    yield host.portal.enter(open_twoturn)


def drive(host: Host, env: VerifiersEnvironment, index: int, rollout: str) -> Driven:
    async def run() -> Driven:
        prompt = await env.prompt(index)
        return await env.episode(prompt).drive(host.fake.model_url(rollout))

    return host.portal.run(run)


def test_hello_counts_the_tasks_and_prompts_draw_them_epoch_by_epoch(host: Host) -> None:
    assert host.arith.hello["ok"] and host.arith.tasks == 12
    assert (host.arith.hello["env"], host.arith.hello["taskset"]) == (
        "SingleAgentEnv",
        "ArithTaskset",
    )
    assert host.arith.hello["verifiers"] == "0.4.0"

    async def prompts() -> list[Any]:
        return [await host.arith.prompt(index) for index in (*range(24), 5)]

    drawn = host.portal.run(prompts)
    first, second = drawn[:12], drawn[12:24]
    assert sorted(p.prompt_id for p in first) == sorted(f"task-{i}" for i in range(12))
    assert sorted(p.prompt_id for p in second) == sorted(p.prompt_id for p in first)
    assert [p.prompt_id for p in first] != [f"task-{i}" for i in range(12)]  # shuffled
    assert drawn[24].prompt_id == drawn[5].prompt_id  # the same index, the same task
    prompt = drawn[13]
    assert prompt.env == "arith" and len(prompt.token_ids) == 0
    assert prompt.info["epoch"] == 1 and prompt.prompt_id == f"task-{prompt.info['index']}"
    assert prompt.sampling.max_turns == 1 and prompt.sampling.max_tokens == 8


def test_a_single_turn_episode_reports_the_reward_and_what_was_sampled(host: Host) -> None:
    fake = host.fake
    right = drive(host, host.arith, 0, "right-1")
    (call,) = fake.calls("right-1")
    answer = answering(host.tokenizer)("right-1", call.body["token_ids"], 0)
    assert right.completions == (tuple(answer),)
    chars = len(host.tokenizer.tokenizer.decode(answer[:-1]))
    # Rewarded 1 for the right number, 0.25 for a number; its metric: the reply's length.
    assert (right.reward, right.metrics, right.error) == (1.25, {"reply_chars": chars}, None)
    # What verifiers sends: the rendered prompt, the sampling, the rollout's session.
    assert re.fullmatch(r"[0-9a-f]{32}", call.session or "")
    assert call.body["model"] == "policy"
    params = call.body["sampling_params"]
    assert params == {
        "temperature": 1.0,
        "top_p": 0.95,
        "top_k": -1,
        "max_tokens": 8,
        "stop_token_ids": [EOS],
        "logprobs": 1,
        "skip_special_tokens": False,
    }
    text = host.tokenizer.tokenizer.decode(call.body["token_ids"])
    assert "Answer with a number." in text and text.endswith("<|im_start|>assistant\n")
    # Its context length is asked once per worker, with no session.
    models = [seen for seen in fake.seen if seen.path == "/v1/models"]
    assert len(models) <= 2 and all(seen.session is None for seen in models)


def test_episodes_run_side_by_side_each_with_its_session(host: Host) -> None:
    rollouts = ["right-a", "right-b", "fixed-c"]

    async def side_by_side() -> list[Driven]:
        results: list[Driven] = [Driven(None)] * len(rollouts)

        async def one(index: int) -> None:
            prompt = await host.arith.prompt(100 + index)
            url = host.fake.model_url(rollouts[index])
            results[index] = await host.arith.episode(prompt).drive(url)

        async def abandoned() -> None:  # a drive cancelled midway: the worker drops it
            arrived, release = host.fake.hold("abandoned")
            prompt = await host.arith.prompt(99)
            with trio.move_on_after(60) as scope:
                async with trio.open_nursery() as inner:
                    inner.start_soon(
                        host.arith.episode(prompt).drive, host.fake.model_url("abandoned")
                    )
                    await arrived.wait()
                    scope.cancel()
            release.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(abandoned)
            for index in range(len(rollouts)):
                nursery.start_soon(one, index)
        return results

    right_a, right_b, fixed = host.portal.run(side_by_side)
    assert (right_a.reward, right_b.reward) == (1.25, 1.25)
    assert host.arith._worker is not None and not host.arith._worker.pending
    assert fixed.completions == ((478, EOS),) and fixed.reward in (0.25, 1.25)
    sessions = {host.fake.calls(rollout)[0].session for rollout in rollouts}
    assert len(sessions) == 3


def test_a_multi_turn_episode_reports_each_calls_completion_in_order(
    host: Host, twoturn: VerifiersEnvironment
) -> None:
    assert (twoturn.hello["env"], twoturn.tasks) == ("TwoTurnEnv", 100)
    fake = host.fake
    driven = drive(host, twoturn, 3, "right-two")
    first, second = fake.calls("right-two")
    sample = answering(host.tokenizer)
    assert driven.completions == (
        tuple(sample("right-two", first.body["token_ids"], 0)),
        tuple(sample("right-two", second.body["token_ids"], 1)),
    )
    assert (driven.reward, driven.metrics, driven.error) == (1.0, {"first_correct": 1.0}, None)
    assert first.session == second.session
    # The second prompt: the first, its completion, then the second user turn (the
    # tokenizer's own template re-renders the whole conversation; nothing is bridged).
    prefix = [*first.body["token_ids"], *driven.completions[0]]
    assert second.body["token_ids"][: len(prefix)] == prefix
    assert "Check it and answer again" in host.tokenizer.tokenizer.decode(
        second.body["token_ids"][len(prefix) :]
    )
    assert "routed_experts_prompt_start" not in second.body["sampling_params"]


def test_an_endpoint_that_fails_fails_the_episode_a_5xx_after_two_retries(host: Host) -> None:
    """The environment's program calls the model with OpenAI's SDK, which retries a 5xx
    twice (and a 408, 409, 429), never another 4xx: each retry comes back to the endpoint
    as the same turn."""
    host.fake.fail("failing-500", 500)
    host.fake.fail("failing-400", 400)

    async def run(rollout: str) -> tuple[Driven, ScoreFailed]:
        episode = host.arith.episode(await host.arith.prompt(2))
        driven = await episode.drive(host.fake.model_url(rollout))
        with pytest.raises(ScoreFailed) as failed:
            await episode.score([])
        return driven, failed.value

    async def both() -> list[tuple[Driven, ScoreFailed]]:
        results: dict[str, tuple[Driven, ScoreFailed]] = {}

        async def one(rollout: str) -> None:
            results[rollout] = await run(rollout)

        async with trio.open_nursery() as nursery:
            for rollout in ("failing-500", "failing-400"):
                nursery.start_soon(one, rollout)
        return [results["failing-500"], results["failing-400"]]

    outcomes = host.portal.run(both)
    for (driven, failed), status, calls in zip(outcomes, (500, 400), (3, 1), strict=True):
        assert driven.reward is None and driven.completions == ()
        assert driven.error is not None
        assert driven.error.startswith(f"ProviderError: Error code: {status} - "), driven.error
        assert "injected failure" in driven.error
        assert failed.kind == "raised" and failed.detail == driven.error
        seen = host.fake.calls(f"failing-{status}")
        assert len(seen) == calls and len({call.session for call in seen}) == 1


def test_a_killed_worker_fails_its_episodes_and_the_next_call_starts_it_again(host: Host) -> None:
    fake, arith = host.fake, host.arith
    arrived, release = fake.hold("held")

    async def kill_mid_episode() -> tuple[Driven, ScoreFailed]:
        episode = arith.episode(await arith.prompt(7))
        outcome: list[Driven] = []

        async def run() -> None:
            outcome.append(await episode.drive(fake.model_url("held")))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await arrived.wait()
            worker = arith._worker
            assert worker is not None
            os.kill(worker.process.pid, signal.SIGKILL)
        release.set()
        with pytest.raises(ScoreFailed) as failed:
            await episode.score([])
        return outcome[0], failed.value

    driven, failed = host.portal.run(kill_mid_episode)
    assert driven.reward is None and driven.error is not None
    assert driven.error.startswith("the verifiers worker died: it was killed by signal 9")
    assert failed.kind == "worker_died"
    again = drive(host, arith, 8, "right-after")
    assert again.reward == 1.25 and again.error is None
    assert arith._restarts_in_a_row == 0 and arith.tasks == 12

    # Past `max_restarts` restarts in a row, the next call stops the run, saying why.
    max_restarts, arith.max_restarts = arith.max_restarts, 0
    try:
        worker = arith._worker
        assert worker is not None
        os.kill(worker.process.pid, signal.SIGKILL)
        with pytest.raises(UserError) as stopped:
            drive(host, arith, 9, "after-the-last")
    finally:
        # The module's other tests share this environment (in whatever order xdist runs
        # them): its next call starts the worker again.
        arith.max_restarts = max_restarts
    assert str(stopped.value) == (
        "env arith: the verifiers worker keeps dying (0 restarts in a row, no answer in "
        "between; last: it was killed by signal 9)"
    )
    assert drive(host, arith, 10, "right-again").reward == 1.25


def test_check_config_names_an_unknown_id_and_wrong_args_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(DEMO_ENVS))

    def problem(name: str, env: str) -> str:
        path = tmp_path / f"{name}.toml"
        path.write_text(
            f'run_dir = "{tmp_path / "run"}"\n'
            '[inference]\nurls = ["http://127.0.0.1:9"]\n'
            f'[model]\ntokenizer = "{MODEL}"\n'
            f'[[env]]\nname = "first"\n{env}\n'
        )
        with pytest.raises(UserError) as error:
            check_tasks(load_config(path))  # a trio run of its own, in this thread
        return str(error.value)

    envs = [
        'verifiers = "no-such-env"',
        'verifiers = "vf-arith"\nargs = {taskset = {count = "x"}}',
        # renderers' qwen3 asserts Qwen3's tool-call tokens, which demo/model lacks.
        'verifiers = "vf-twoturn"\nrenderer = {name = "qwen3"}',
    ]
    with ThreadPoolExecutor(3) as pool:  # the workers load side by side
        unknown, wrong, renderer = pool.map(problem, ["unknown", "wrong", "renderer"], envs)
    assert unknown == (
        "env[0].verifiers: no verifiers taskset 'no-such-env' is installed (no module "
        "'no_such_env'): install its package into this environment, or put its folder on "
        "PYTHONPATH"
    )
    assert wrong == (
        "env[0].verifiers: args.taskset.count: Input should be a valid integer, unable to "
        "parse string as an integer"
    )
    assert renderer == (
        f"env[0].verifiers: vf-twoturn: its renderer 'qwen3' does not load with the "
        f"tokenizer {MODEL}: AssertionError: Special token '<tool_call>' not found in "
        "tokenizer vocabulary"
    )


def worker_without_verifiers(path: str, spec: WorkerSpec, folder: Path) -> subprocess.Popen[bytes]:
    """The worker started on `path` with `folder` (its `sitecustomize`) on PYTHONPATH."""
    return subprocess.Popen(
        [sys.executable, "-m", WORKER_MODULE, "--socket", path, "--config", spec.config_json()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(folder)},
    )


def connected(path: str, process: subprocess.Popen[bytes]) -> socket.socket:
    """A connection to the worker listening at `path`, once it listens."""
    client = socket.socket(socket.AF_UNIX)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.connect(path)
            return client
        except OSError:
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.02)


def test_the_worker_answers_every_request_prints_nothing_and_ends_with_its_peer(
    tmp_path: Path,
) -> None:
    """Here without verifiers (a `sitecustomize` blocks its import, as where the extra is
    not installed): it says so to every request, then exits when its peer leaves, or on
    SIGTERM."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['verifiers'] = None\n")
    path = str(tmp_path / "w.sock")
    spec = WorkerSpec("x", "vf-arith", MODEL)
    process = worker_without_verifiers(path, spec, tmp_path)
    try:
        with connected(path, process) as client, client.makefile("rb") as reader:
            client.sendall(b'{"id": 1, "op": "hello"}\n{"id": 2, "op": "task", "index": 0}\n')
            answers = [json.loads(reader.readline()) for _ in range(2)]
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert sorted(a["id"] for a in answers) == [1, 2]
    assert all(
        a == {"id": a["id"], "ok": False, "error": f"verifiers is not installed: {INSTALL_LINE}"}
        for a in answers
    )
    assert process.returncode == 0 and out == b"", err

    # And on SIGTERM, its peer still there.
    process = worker_without_verifiers(path, spec, tmp_path)
    try:
        with connected(path, process) as client, client.makefile("rb") as reader:
            client.sendall(b'{"id": 1, "op": "hello"}\n')
            assert not json.loads(reader.readline())["ok"]
            process.send_signal(signal.SIGTERM)
            out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 0 and out == b"", err

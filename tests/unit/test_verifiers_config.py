"""`[[env]] verifiers = "ID"` in the config (one line naming the key for each rule), the
refusal of a verifiers env where verifiers is not installed (with the line that installs
it, found without importing verifiers), and the pure pieces of the worker and of the
daemon's side: merging the env config, tasks by index, a `run` answer read as `Driven`."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace as Record

import pytest
from cli_kit import refused

from orchestrator.config import ConfigError, load_config
from orchestrator.core.environments import Driven
from orchestrator.errors import UserError
from orchestrator.tasks.build import load_tasks
from orchestrator.tasks.verifiers_env.environment import WorkerSpec, _driven, _python_path
from orchestrator.tasks.verifiers_env.protocol import INSTALL_LINE, one_line, verifiers_installed
from orchestrator.tasks.verifiers_env.worker import Tasks, deep_merge, task_id

MODEL = Path(__file__).resolve().parents[2] / "demo" / "model"

BASE = f"""
run_dir = "run"
[inference]
urls = ["http://a:1"]
[model]
tokenizer = "{MODEL}"
"""

ENV = """
[[env]]
name = "arith"
verifiers = "vf-arith"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_a_verifiers_env_with_its_args_renderer_and_sampling(tmp_path: Path) -> None:
    text = (
        BASE
        + ENV
        + (
            "args = {taskset = {count = 10}, agent = {max_turns = 2}}\n"
            'renderer = {name = "qwen3"}\n'
            "max_tokens = 64\nmax_turns = 3\n"
            '[eval]\nnum_examples = 4\n[[eval.env]]\nname = "held-out"\n'
            'verifiers = "owner/vf-arith@0.1"\n'
        )
    )
    config = load_config(write(tmp_path, text))
    (env,) = config.env
    assert (env.verifiers, env.dataset, env.factory) == ("vf-arith", None, None)
    assert env.args == {"taskset": {"count": 10}, "agent": {"max_turns": 2}}
    assert env.renderer == {"name": "qwen3"}
    assert (env.max_tokens, env.max_turns, env.rewards) == (64, 3, ())
    assert config.eval.env[0].verifiers == "owner/vf-arith@0.1"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('dataset = "/data/a.jsonl"', 'env[0].name = "arith" needs exactly one of dataset'),
        ('factory = "p:f"', "and verifiers (an environment written for verifiers)"),
        ('prompt = "question"', 'env[0].prompt = "question" is a dataset column'),
        ('rewards = ["r:f"]', 'env[0].rewards = ["r:f"] does not apply: a verifiers'),
        ("max_tokens = 8192", "env[0].max_tokens = 8192 must be below batch.max_seq_len"),
    ],
)
def test_verifiers_env_rules_name_the_key(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, BASE + ENV + extra + "\n"))
    assert message in str(error.value), str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (ENV.replace('"vf-arith"', '"two words"'), 'env[0].verifiers = "two words" must be a'),
        (ENV.replace('"vf-arith"', '""'), 'env[0].verifiers = "" must be a verifiers'),
        (
            ENV.replace('verifiers = "vf-arith"', 'dataset = "/d.jsonl"\nprompt = "q"\n')
            + 'rewards = ["r:f"]\nrenderer = {name = "qwen3"}\n',
            "is a verifiers environment's renderer: set verifiers too",
        ),
        (
            ENV.replace('verifiers = "vf-arith"', 'dataset = "/d.jsonl"\nprompt = "q"\n')
            + 'rewards = ["r:f"]\nargs = {a = 1}\n',
            "are the factory's arguments (or a verifiers environment's config): set factory "
            "or verifiers too",
        ),
        (
            ENV.replace("[[env]]", "[[eval.env]]") + "prompt = 'q'\n",
            'eval.env[0].prompt = "q" is a dataset column',
        ),
    ],
)
def test_other_rules_name_the_key(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, BASE + text))
    assert message in str(error.value), str(error.value)


def test_without_verifiers_installed_it_is_refused_with_the_install_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert verifiers_installed()  # the dev environment has the extra
    # How Python blocks an import: `find_spec` finds nothing, `import` raises.
    monkeypatch.setitem(sys.modules, "verifiers", None)
    assert not verifiers_installed()
    path = write(tmp_path, BASE + ENV)
    with pytest.raises(UserError) as error:
        load_tasks(load_config(path))
    assert str(error.value) == f"env[0].verifiers: verifiers is not installed: {INSTALL_LINE}"
    line = refused(capsys, "check-config", str(path))
    assert line == (
        "orchestrator check-config: error: env[0].verifiers: verifiers is not installed: "
        "pip install 'rollout-orchestrator[verifiers]'\n"
    )


def test_the_env_config_is_the_users_args_merged_table_by_table() -> None:
    ours = {"taskset": {"id": "vf-arith"}, "agent": {"runtime": {"type": "subprocess"}}}
    users = {"taskset": {"count": 3}, "agent": {"runtime": {"type": "docker"}, "max_turns": 2}}
    assert deep_merge(ours, users) == {
        "taskset": {"id": "vf-arith", "count": 3},
        "agent": {"runtime": {"type": "docker"}, "max_turns": 2},
    }
    assert ours == {"taskset": {"id": "vf-arith"}, "agent": {"runtime": {"type": "subprocess"}}}


class Taskset:
    """A verifiers taskset as the worker reads it: `bounded`, iteration, `skip`."""

    def __init__(self, count: int | None, start: int = 0) -> None:
        self.count, self.start, self.reads = count, start, 0

    @property
    def bounded(self) -> bool:
        return self.count is not None

    def __iter__(self) -> object:
        index = self.start
        while self.count is None or index < self.count:
            self.reads += 1
            yield Record(data=Record(id=None if index % 2 else f"q{index}", idx=index))
            index += 1

    def skip(self, count: int) -> Taskset:
        return Taskset(self.count, self.start + count)


def test_a_finite_tasksets_tasks_go_round_and_an_infinite_ones_are_read_on() -> None:
    finite = Tasks(Taskset(3))
    assert finite.count == 3
    assert [task_id(finite.get(i)) for i in range(7)] == [
        "q0",
        "task-1",
        "q2",
        "q0",
        "task-1",
        "q2",
        "q0",
    ]
    infinite = Tasks(Taskset(None))
    assert infinite.count is None
    assert [task_id(infinite.get(i)) for i in (0, 1, 5, 2, 1000)] == [
        "q0",
        "task-1",
        "task-5",
        "q2",
        "q1000",
    ]
    with pytest.raises(ValueError, match="must not be negative"):
        finite.get(-1)


def test_a_run_answer_reads_as_driven() -> None:
    answer = {
        "ok": True,
        "reward": 1,
        "metrics": {"has_number": 1},
        "completions": [[478, 2], [621, 17, 2]],
        "stop_condition": "agent_completed",
        "error": None,
    }
    assert _driven(answer) == Driven(1.0, ((478, 2), (621, 17, 2)), {"has_number": 1.0})
    failed = _driven({**answer, "reward": None, "error": "ProviderError:\n 500"})
    assert (failed.reward, failed.error) == (None, "ProviderError: 500")
    # The calls that failed on their way (the relay's 502), for the run's failures.
    flaky = _driven({**answer, "failed_calls": [[502, "the endpoint failed:\n reset"]]})
    assert flaky.reward == 1.0 and flaky.failed_calls == ((502, "the endpoint failed: reset"),)
    broken = _driven({**answer, "completions": [["x"]]})
    assert broken.reward is None and broken.error is not None
    assert broken.error.startswith("the worker's answer does not read")


def test_the_workers_config_and_path() -> None:
    spec = WorkerSpec("arith", "vf-arith", MODEL, args={"taskset": {"count": 3}}, max_turns=2)
    assert '"verifiers": "vf-arith"' in spec.config_json()
    entries = _python_path().split(":")
    assert not any(entry.startswith(sys.prefix) for entry in entries)
    assert one_line("a\n  b\tc", limit=4) == "a..."

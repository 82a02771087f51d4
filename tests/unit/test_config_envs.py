"""`[model]`, `[[env]]` and `[rewards]`: the real tasks' keys, their rules in one line
naming the key, `--set` into an array of tables, and the toy environment's keys in
`[sim]` when no `[[env]]` is listed."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.config import ConfigError, load_config

BASE = """
run_dir = "run"
[inference]
urls = ["http://a:1"]
[model]
tokenizer = "/models/m"
"""

ENV = """
[[env]]
name = "arith"
dataset = "/data/arith.jsonl"
prompt = "question"
rewards = ["my_rewards:correct"]
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_an_env_with_its_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, BASE + ENV))
    (env,) = config.env
    assert env.name == "arith" and env.dataset == Path("/data/arith.jsonl")
    assert (env.max_tokens, env.temperature, env.top_p, env.top_k) == (512, 1.0, 0.95, 50)
    assert env.weights == (1.0,) and env.ratio == 1.0
    assert config.model.tokenizer == Path("/models/m")
    assert (config.rewards.workers, config.rewards.timeout_s) == (0, 30.0)
    assert config.max_completion_tokens == 512


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('messages = "chat"', "needs exactly one of prompt"),
        ('factory = "p:f"', "needs exactly one of dataset"),
        ("reward_weights = [1.0, 2.0]", "reward_weights = [1.0, 2.0] must have one weight"),
        ("ratio = 0", "env[0].ratio = 0.0 must be > 0"),
        ("max_tokens = 9000", "env[0].max_tokens = 9000 must be below batch.max_seq_len"),
        ('name = "no spaces"', "must be a name of letters"),
        ("top_p = 1.5", "env[0].top_p"),
    ],
)
def test_env_rules_name_the_key(tmp_path: Path, extra: str, message: str) -> None:
    text = BASE + ENV.replace('name = "arith"\n', "") + extra + "\n"
    if "name =" not in extra:
        text = text.replace("[[env]]\n", '[[env]]\nname = "arith"\n')
    with pytest.raises(ConfigError, match=r"run\.toml") as error:
        load_config(write(tmp_path, text))
    assert message in str(error.value), str(error.value)
    assert "\n" not in str(error.value)


def test_no_rewards_two_envs_of_one_name_and_no_tokenizer_are_refused(tmp_path: Path) -> None:
    no_rewards = ENV.replace('rewards = ["my_rewards:correct"]\n', "")
    with pytest.raises(ConfigError, match=r"env\[0\]\.rewards = \[\] must list at least one"):
        load_config(write(tmp_path, BASE + no_rewards))
    with pytest.raises(ConfigError, match=r"env\[1\]\.name = \"arith\" names another"):
        load_config(write(tmp_path, BASE + ENV + ENV))
    with pytest.raises(ConfigError, match=r"model\.tokenizer must name the model's local"):
        load_config(write(tmp_path, BASE.replace('tokenizer = "/models/m"', "") + ENV))


def test_set_reaches_into_the_array_of_tables(tmp_path: Path) -> None:
    path = write(tmp_path, BASE + ENV + ENV.replace('"arith"', '"chat"'))
    config = load_config(path, ["env.1.max_tokens=16", "env.0.ratio=3"])
    assert [(e.name, e.max_tokens, e.ratio) for e in config.env] == [
        ("arith", 512, 3.0),
        ("chat", 16, 1.0),
    ]
    with pytest.raises(ConfigError, match=r"'env\.2' is past the array of tables"):
        load_config(path, ["env.2.max_tokens=16"])
    # A whole array in TOML; an empty one leaves the toy environment.
    assert load_config(path, ["env=[]"]).env == ()


def test_without_envs_the_toy_environment_keys_are_in_sim(tmp_path: Path) -> None:
    config = load_config(
        write(tmp_path, BASE + '[sim]\nenv = "chat"\nmax_tokens = 9\nprompt_len_max = 99\n')
    )
    assert config.env == () and config.sim.env == "chat"
    assert config.max_completion_tokens == 9
    with pytest.raises(ConfigError, match=r"sim\.eos_token_id = 9 must be below sim\.vocab_size"):
        load_config(write(tmp_path, BASE + "[sim]\nvocab_size = 9\neos_token_id = 9\n"))

"""config_to_toml: what it writes reads back to an equal Config."""

from __future__ import annotations

import tomllib
from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.config import (
    BatchConfig,
    Config,
    EnvConfig,
    InferenceConfig,
    ModelConfig,
    PayloadConfig,
    RewardsConfig,
    SimConfig,
    StalenessConfig,
    TrainerConfig,
    config_to_toml,
    load_config,
)
from orchestrator.config.errors import format_toml_value

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def reload(config: Config, tmp_path: Path) -> Config:
    path = tmp_path / "resolved.toml"
    path.write_text(config_to_toml(config), encoding="utf-8")
    return load_config(path)


def test_defaults_round_trip(tmp_path: Path) -> None:
    config = Config(run_dir=tmp_path / "run", inference=InferenceConfig(urls=("http://a:1",)))
    assert reload(config, tmp_path) == config


def test_every_value_changed_round_trips(tmp_path: Path) -> None:
    config = Config(
        run_dir=tmp_path / 'odd "run" dir\twith\\escapes',
        max_steps=7,
        seed=-3,
        staleness=StalenessConfig(max_off_policy_steps=5, max_async_steps=5),
        batch=BatchConfig(
            size=3,
            group_size=2,
            constant_size=False,
            max_seq_len=2,
            curriculum_min_mean_reward=-1.0,
            curriculum_max_mean_reward=-1.0,
        ),
        payload=PayloadConfig(
            mode="inline",
            root=tmp_path / "payloads-ü",
            fields=("sampling_mask",),
            final_token_route="sentinel",
            fsync=True,
        ),
        inference=InferenceConfig(
            urls=("https://a.example:443/v1", "http://[::1]:8000"),
            max_inflight=1,
            request_timeout_s=1e-3,
            retries=0,
            retry_backoff_s=0.0,
            unavailable_deadline_s=1.5,
            disaggregated=True,
            multi_node=True,
        ),
        trainer=TrainerConfig(
            batches_dir=tmp_path / "b",
            weights_dir=tmp_path / "w",
            force_polling=True,
            poll_interval_s=0.1,
        ),
        model=ModelConfig(tokenizer=tmp_path / "model ü"),
        env=(
            EnvConfig(
                name="arith-1",
                dataset=tmp_path / "data.jsonl",
                prompt="question",
                system_prompt='Say "42".',
                answer="answer",
                rewards=("orchestrator.rewards:exact_match", "my.mod:f"),
                reward_weights=(0.5, -2.0),
                ratio=3.5,
                max_tokens=1,
                temperature=0.0,
                top_p=0.5,
                top_k=-1,
            ),
            EnvConfig(
                name="tools",
                factory="my.envs:make",
                args={"n": 3, "names": ["a", "b"], "deep": {"x": 1.5}},
                max_turns=9,
            ),
        ),
        rewards=RewardsConfig(workers=3, timeout_s=0.5),
        sim=SimConfig(
            env="chat",
            prompt_len_min=1,
            prompt_len_max=1,
            max_tokens=1,
            max_turns=9,
            trainer=True,
            train_time_s=0.0,
            layers=1,
            top_k=2,
            num_experts=2,
            vocab_size=5,
            time_per_token_s=0.001,
            http_500_rate=1.0,
            hang_rate=0.5,
            malformed_rate=0.25,
            bad_segment_rate=0.125,
            payload_error_rate=0.1,
            fault_seed=99,
        ),
    )
    assert reload(config, tmp_path) == config


@pytest.mark.parametrize("name", ["demo.toml", "multi-node.toml", "prime-rl.toml"])
def test_shipped_configs_round_trip(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(CONFIGS / name, [f"run_dir={tmp_path / 'run'}"])
    assert reload(config, tmp_path) == config


def test_default_directories_are_comments_not_keys(tmp_path: Path) -> None:
    config = Config(run_dir=tmp_path / "run", inference=InferenceConfig(urls=("http://a:1",)))
    text = config_to_toml(config)
    assert "root" not in tomllib.loads(text)["payload"]
    assert f"# root is not set: it defaults to {tmp_path / 'run' / 'payloads'}" in text
    # So a re-loaded file still follows run_dir when it is overridden.
    path = tmp_path / "resolved.toml"
    path.write_text(text, encoding="utf-8")
    moved = load_config(path, [f"run_dir={tmp_path / 'elsewhere'}"])
    assert moved.payload_root == tmp_path / "elsewhere" / "payloads"


def test_every_key_is_written(tmp_path: Path) -> None:
    config = Config(
        run_dir=tmp_path / "run",
        inference=InferenceConfig(urls=("http://a:1",), api_key_file=tmp_path / "k"),
        payload=PayloadConfig(root=tmp_path / "p"),
        trainer=TrainerConfig(batches_dir=tmp_path / "b", weights_dir=tmp_path / "w"),
        model=ModelConfig(path=tmp_path / "mp", tokenizer=tmp_path / "m"),
        sim=SimConfig(trainer_checkpoint=tmp_path / "c", vocab_size=1000, eos_token_id=3),
    )
    document = tomllib.loads(config_to_toml(config))
    for field in attrs.fields(Config):
        section = getattr(config, field.name)
        if attrs.has(type(section)):
            written = set(document[field.name])
            assert written == {f.name for f in attrs.fields(type(section))}
        else:
            assert field.name in document


toml_scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.floats(allow_nan=False),
    st.text(alphabet=st.characters(exclude_categories=["Cs"])),
)


@settings(max_examples=200, deadline=None)
@given(st.one_of(toml_scalars, st.lists(toml_scalars, max_size=4)))
def test_written_values_read_back_equal(value: object) -> None:
    document = tomllib.loads(f"value = {format_toml_value(value)}")
    assert document["value"] == value
    assert type(document["value"]) is type(value)


def test_values_toml_cannot_hold_are_refused() -> None:
    with pytest.raises(TypeError):
        format_toml_value(None)
    with pytest.raises(TypeError):
        format_toml_value({"a": 1})


def test_values_in_messages_stay_on_one_line() -> None:
    # tomli-w spreads an array over several lines; a message keeps it on one.
    assert format_toml_value(("a", Path("/b"), 1.0)) == '["a", "/b", 1.0]'
    assert format_toml_value("tab\there\n") == '"tab\there\\n"'

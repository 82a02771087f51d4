"""Loading configs: valid files, defaults, paths, and one-line errors for every bad input."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from orchestrator.config import (
    BatchConfig,
    Config,
    ConfigError,
    InferenceConfig,
    SimConfig,
    StalenessConfig,
    load_config,
)
from orchestrator.errors import UserError

MINIMAL = 'run_dir = "run"\n[inference]\nurls = ["http://inference-0:8000"]\n'


def write(tmp_path: Path, text: str, name: str = "config.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Relative paths resolve against the CWD, and HOME is refused as a payload root:
    # pin both so the tests neither depend on nor touch the real ones.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def test_minimal_config_gets_the_documented_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL))
    assert config.run_dir == tmp_path / "run"
    assert config.max_steps == 0
    assert config.seed == 0
    assert config.staleness == StalenessConfig(max_off_policy_steps=2, max_async_steps=1)
    assert (config.batch.size, config.batch.group_size) == (64, 8)
    assert config.batch.constant_size is True
    assert config.batch.max_seq_len == 8192
    assert config.payload.mode == "auto"
    assert config.payload.fields == ("routed_experts", "sampling_mask")
    assert config.payload.final_token_route == "repeat"
    assert config.inference.urls == ("http://inference-0:8000",)
    assert config.inference.request_timeout_s == 600.0
    assert config.trainer.poll_interval_s == 1.0
    # No [[env]]: the simulator's toy environment.
    assert config.env == ()
    assert config.sim.env == "mixed"
    assert (config.sim.prompt_len_min, config.sim.prompt_len_max) == (64, 512)
    assert (config.sim.max_tokens, config.sim.max_turns) == (256, 3)
    assert config.model.tokenizer is None
    assert (config.sim.layers, config.sim.top_k, config.sim.num_experts) == (48, 8, 128)
    assert config.metrics.listen == ""
    assert config.shutdown.grace_s == 10.0


def test_directories_resolve_against_the_cwd_and_default_below_run_dir(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL))
    run = tmp_path / "run"
    assert config.payload_root == run / "payloads"
    assert config.batches_dir == run / "batches"
    assert config.weights_dir == run / "weights"
    assert config.state_dir == run / "orchestrator"


def test_explicit_directories_are_made_absolute_without_following_links(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    text = MINIMAL + (
        '[payload]\nroot = "link/payloads"\n'
        '[trainer]\nbatches_dir = "out/../b"\nweights_dir = "/abs/w"\n'
    )
    config = load_config(write(tmp_path, text))
    # The link stays in the path: the collector must see it to refuse it.
    assert config.payload_root == tmp_path / "link" / "payloads"
    assert config.batches_dir == tmp_path / "b"
    assert config.weights_dir == Path("/abs/w")


def test_integers_are_accepted_for_floats_and_stored_as_floats(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL + "request_timeout_s = 30\n"))
    assert config.inference.request_timeout_s == 30.0
    assert type(config.inference.request_timeout_s) is float


def test_overrides_take_toml_values_and_bare_words(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    config = load_config(
        path,
        [
            "run_dir=/tmp/elsewhere",
            "staleness.max_off_policy_steps=3",
            'inference.urls=["http://a:1", "http://b:2"]',
            "inference.multi_node=true",
            "metrics.listen=",
            "sim.train_time_s=0.25",
        ],
    )
    assert config.run_dir == Path("/tmp/elsewhere")
    assert config.staleness.max_off_policy_steps == 3
    assert config.inference.urls == ("http://a:1", "http://b:2")
    assert config.inference.multi_node is True
    assert config.metrics.listen == ""
    assert config.sim.train_time_s == 0.25


def test_later_overrides_win(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL), ["seed=1", "seed=2"])
    assert config.seed == 2


def test_an_override_can_create_a_section_absent_from_the_file(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, MINIMAL), ["shutdown.grace_s=3"])
    assert config.shutdown.grace_s == 3.0


def test_config_error_is_a_user_error() -> None:
    # The CLI prints UserError as one line with exit code 2.
    assert issubclass(ConfigError, UserError)


def test_direct_construction_runs_the_same_checks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"max_async_steps = 3 must be <= "):
        StalenessConfig(max_off_policy_steps=2, max_async_steps=3)
    config = Config(run_dir="run", inference=InferenceConfig(urls=("http://a:1",)))
    assert config.run_dir == tmp_path / "run"
    with pytest.raises(ConfigError, match=r"inference\.urls = \[\] must list"):
        Config(run_dir="run")
    evolved = attrs.evolve(config, sim=SimConfig(inference_servers=1), inference=InferenceConfig())
    assert evolved.inference_hosts == frozenset({"127.0.0.1"})


# (test id, file text after MINIMAL's run_dir, overrides, key the message must name)
BAD_INPUTS: list[tuple[str, str, list[str], str]] = [
    ("unknown top-level key", "max_step = 3\n" + MINIMAL, [], "'max_step'"),
    (
        "unknown nested key",
        MINIMAL + "[staleness]\nmax_of_policy_steps = 2\n",
        [],
        "'staleness.max_of_policy_steps'",
    ),
    ("unknown section", MINIMAL + "[stalenes]\nmax_async_steps = 1\n", [], "'stalenes'"),
    ("string for int", MINIMAL + '[batch]\nsize = "64"\n', [], "batch.size"),
    ("int for bool", MINIMAL + "[trainer]\nforce_polling = 1\n", [], "trainer.force_polling"),
    ("bool for int", MINIMAL, ["inference.retries=true"], "inference.retries"),
    ("bool for float", MINIMAL, ["shutdown.grace_s=true"], "shutdown.grace_s"),
    ("list for str", MINIMAL + '[metrics]\nlisten = ["a:1"]\n', [], "metrics.listen"),
    ("string for list", MINIMAL, ['payload.fields="sampling_mask"'], "payload.fields"),
    ("int in a list of str", MINIMAL, ["inference.urls=[1]"], "inference.urls[0]"),
    ("scalar for section", "batch = 3\n" + MINIMAL, [], "batch = 3 must be a table"),
    ("date for float", MINIMAL, ["shutdown.grace_s=2024-01-01"], "grace_s = 2024-01-01 must"),
    ("infinite float", MINIMAL, ["inference.request_timeout_s=inf"], "request_timeout_s"),
    ("negative limit", MINIMAL + "[staleness]\nmax_off_policy_steps = -1\n", [], "max_off_p"),
    ("negative retries", MINIMAL, ["inference.retries=-1"], "inference.retries"),
    ("zero batch", MINIMAL, ["batch.size=0"], "batch.size"),
    ("group of one", MINIMAL, ["batch.group_size=1"], "batch.group_size = 1 must be >= 2"),
    ("zero timeout", MINIMAL, ["inference.request_timeout_s=0"], "request_timeout_s"),
    ("rate above one", MINIMAL, ["sim.hang_rate=1.5"], "sim.hang_rate"),
    (
        "async above off-policy",
        MINIMAL + "[staleness]\nmax_off_policy_steps = 2\nmax_async_steps = 3\n",
        [],
        "staleness.max_async_steps = 3 must be <= staleness.max_off_policy_steps (2)",
    ),
    ("prompt min above max", MINIMAL, ["sim.prompt_len_min=600"], "sim.prompt_len_max"),
    ("top_k above experts", MINIMAL, ["sim.top_k=200"], "sim.top_k = 200"),
    ("unknown literal", MINIMAL, ['payload.mode="handle"'], 'did you mean "by_handle"'),
    ("duplicate field", MINIMAL, ['payload.fields=["sampling_mask","sampling_mask"]'], "fields"),
    ("payload root /", MINIMAL + '[payload]\nroot = "/"\n', [], "payload.root"),
    ("payload root home", MINIMAL, ['payload.root="home"'], "payload.root"),
    ("payload root above home", MINIMAL, ["payload.root=."], "payload.root"),
    ("payload root in batches", MINIMAL, ['payload.root="run/batches/p"'], "batches_dir"),
    ("payload root is weights", MINIMAL, ['payload.root="run/weights"'], "weights_dir"),
    ("payload root holds state", MINIMAL, ['payload.root="run"'], "payload.root"),
    ("run_dir /", MINIMAL, ['run_dir="/"'], "run_dir"),
    (
        "batches equal weights",
        MINIMAL,
        ['trainer.batches_dir="w"', 'trainer.weights_dir="w"'],
        "trainer.batches_dir",
    ),
    ("no inference", 'run_dir = "run"\n', [], "inference.urls"),
    ("urls and local servers", MINIMAL, ["sim.inference_servers=2"], "inference.urls"),
    ("bad URL scheme", MINIMAL, ['inference.urls=["ftp://a:1"]'], "inference.urls[0]"),
    ("URL without host", MINIMAL, ['inference.urls=["http://:8000"]'], "inference.urls[0]"),
    ("URL with bad port", MINIMAL, ['inference.urls=["http://a:99999"]'], "inference.urls[0]"),
    ("bad listen address", MINIMAL, ["metrics.listen=9464"], "metrics.listen"),
    (
        "missing run_dir",
        '[inference]\nurls = ["http://a:1"]\n',
        [],
        "missing required key 'run_dir'",
    ),
    ("empty run_dir", MINIMAL, ['run_dir=""'], "run_dir"),
    ("invalid TOML", MINIMAL + "[batch\nsize = 3\n", [], "invalid TOML at line 4"),
    ("duplicate TOML key", MINIMAL + "seed = 1\nseed = 2\n", [], "invalid TOML at line 5"),
    (
        "unknown --set key",
        MINIMAL,
        ["staleness.max_of_policy_steps=2"],
        "did you mean 'staleness.max_off_policy_steps'",
    ),
    (
        "--set key in wrong section",
        MINIMAL,
        ["max_async_steps=2"],
        "did you mean 'staleness.max_async_steps'",
    ),
    ("--set through a value", MINIMAL, ["run_dir.x=1"], "'run_dir' is a value"),
]


@pytest.mark.parametrize(
    ("text", "overrides", "named"),
    [pytest.param(text, overrides, named, id=name) for name, text, overrides, named in BAD_INPUTS],
)
def test_bad_input_is_one_line_naming_the_key_and_the_file(
    tmp_path: Path, text: str, overrides: list[str], named: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path, overrides)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    assert named in message


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("no_equals_sign", "expected KEY=VALUE"),
        ("=3", "expected KEY=VALUE"),
        ("bad key=3", "expected KEY=VALUE"),
        ("a..b=3", "expected KEY=VALUE"),
        ("inference.urls=[http://a]", "--set inference.urls=[http://a]: invalid TOML value"),
        ('run_dir="/unterminated', "invalid TOML value"),
        ("seed=1\nrun_dir='x'", "single TOML value"),
    ],
)
def test_bad_override_syntax_is_one_line(tmp_path: Path, override: str, named: str) -> None:
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError) as caught:
        load_config(path, [override])
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("--set ")
    assert named in message


def test_an_error_from_an_override_says_so(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    with pytest.raises(ConfigError) as caught:
        load_config(path, ["batch.size=0"])
    assert str(caught.value).startswith(f"{path} (--set batch.size): batch.size = 0 must be >= 1")


def test_the_messages_read_well(tmp_path: Path) -> None:
    # Exact wording for the commonest mistakes: a typo, a type slip, a broken rule.
    path = write(tmp_path, MINIMAL + "[staleness]\nmax_of_policy_steps = 2\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == (
        f"{path}: unknown key 'staleness.max_of_policy_steps' "
        "(did you mean 'staleness.max_off_policy_steps'?)"
    )
    path = write(tmp_path, MINIMAL + '[batch]\nsize = "64"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f'{path}: batch.size = "64" must be an integer, not a string'
    path = write(tmp_path, MINIMAL + "[staleness]\nmax_async_steps = 3\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == (
        f"{path}: staleness.max_async_steps = 3 must be <= staleness.max_off_policy_steps (2):"
        " it would generate rollouts it must throw away"
    )


def test_a_group_of_one_is_refused_with_the_reason(tmp_path: Path) -> None:
    # GRPO: one rollout per group has advantage 0 everywhere, so the run never ships.
    path = write(tmp_path, MINIMAL + "[batch]\ngroup_size = 1\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == (
        f"{path}: batch.group_size = 1 must be >= 2: a group of one rollout has no "
        "learning signal (its advantages are all zero)"
    )
    with pytest.raises(ConfigError, match=r"group_size = 0 must be >= 2: a group of one"):
        Config(
            run_dir=tmp_path / "run",
            inference=InferenceConfig(urls=("http://a:1",)),
            batch=BatchConfig(group_size=0),
        )
    assert load_config(path, ["batch.group_size=2"]).batch.group_size == 2


def test_an_unknown_key_is_reported_before_other_problems(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL + '[batch]\nsize = "x"\nsizee = 3\n')
    with pytest.raises(ConfigError, match=r"unknown key 'batch\.sizee' \(did you mean"):
        load_config(path)


def test_missing_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}: no such config file"


def test_a_directory_is_not_a_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"is a directory"):
        load_config(tmp_path)


def test_non_utf8_file_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'run_dir = "caf\xe9"\n')
    with pytest.raises(ConfigError, match=r"not UTF-8 text"):
        load_config(path)


def test_invalid_toml_names_line_column_and_reason(tmp_path: Path) -> None:
    path = write(tmp_path, 'run_dir = "run"\nseed = = 3\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == f"{path}: invalid TOML at line 2, column 8: Invalid value"

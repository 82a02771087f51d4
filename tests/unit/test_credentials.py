"""The servers' bearer token: `[inference] api_key_env` / `api_key_file`, read once, one
line for every way it can be wrong, and never shown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from orchestrator.config import ConfigError, InferenceConfig, load_config
from orchestrator.daemon.inference.credentials import (
    MAX_TOKEN_FILE_BYTES,
    load_bearer_token,
    unauthorized_detail,
)
from orchestrator.daemon.inference.http_clients import open_clients
from orchestrator.errors import UserError

SIM = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"
TOKEN = "sk-test-7f3a9c"


def test_no_setting_means_no_token() -> None:
    assert load_bearer_token(InferenceConfig()) is None


def test_a_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCH_TEST_KEY", TOKEN)
    token = load_bearer_token(InferenceConfig(api_key_env="ORCH_TEST_KEY"))
    assert token is not None
    assert token.authorization == f"Bearer {TOKEN}"
    assert TOKEN not in repr(token) and TOKEN not in str(token)
    assert "ORCH_TEST_KEY" in repr(token)


def test_a_token_file_keeps_only_the_token(tmp_path: Path) -> None:
    path = tmp_path / "key"
    path.write_text(f"  {TOKEN}\n")
    token = load_bearer_token(InferenceConfig(api_key_file=path))
    assert token is not None and token.value == TOKEN
    assert repr(token) == f'BearerToken(from inference.api_key_file = "{path}")'


def problem(inference: InferenceConfig) -> str:
    with pytest.raises(UserError) as refused:
        load_bearer_token(inference)
    text = str(refused.value)
    assert "\n" not in text
    return text


def test_an_unset_or_empty_variable_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCH_TEST_KEY", raising=False)
    assert problem(InferenceConfig(api_key_env="ORCH_TEST_KEY")) == (
        'inference.api_key_env = "ORCH_TEST_KEY": the daemon\'s environment has no variable '
        "ORCH_TEST_KEY"
    )
    monkeypatch.setenv("ORCH_TEST_KEY", " \n")
    assert problem(InferenceConfig(api_key_env="ORCH_TEST_KEY")).endswith("the token is empty")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", "the token is empty"),
        (b"two words\n", "the token has spaces or characters a header cannot carry"),
        (b"line\nbreak", "the token has spaces or characters a header cannot carry"),
        ("sk-\u00e9t\u00e9".encode(), "not ASCII text, not a token"),
        (b"x" * (MAX_TOKEN_FILE_BYTES + 1), f"longer than {MAX_TOKEN_FILE_BYTES} bytes"),
    ],
)
def test_a_file_that_holds_no_token_is_refused_without_showing_it(
    tmp_path: Path, content: bytes, expected: str
) -> None:
    path = tmp_path / "key"
    path.write_bytes(content)
    text = problem(InferenceConfig(api_key_file=path))
    assert text.startswith(f'inference.api_key_file = "{path}": ')
    assert expected in text
    assert "words" not in text and "break" not in text


def test_a_file_that_cannot_be_read_is_named(tmp_path: Path) -> None:
    assert problem(InferenceConfig(api_key_file=tmp_path / "absent")).endswith(
        "cannot read it: No such file or directory"
    )
    assert problem(InferenceConfig(api_key_file=tmp_path)).endswith(
        "cannot read it: Is a directory"
    )
    # A FIFO without a writer would hang a plain open.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert problem(InferenceConfig(api_key_file=fifo)).endswith("not a regular file")


def test_a_linked_token_file_is_read(tmp_path: Path) -> None:
    # Kubernetes mounts a secret as links into a timestamped directory.
    (tmp_path / "..data").mkdir()
    (tmp_path / "..data" / "key").write_text(TOKEN)
    (tmp_path / "key").symlink_to(Path("..data") / "key")
    token = load_bearer_token(InferenceConfig(api_key_file=tmp_path / "key"))
    assert token is not None and token.value == TOKEN


def config_problem(*overrides: str) -> str:
    with pytest.raises(ConfigError) as refused:
        load_config(SIM, list(overrides))
    return str(refused.value)


def test_the_config_takes_one_source_and_a_variable_name(tmp_path: Path) -> None:
    both = config_problem('inference.api_key_env="KEY"', f'inference.api_key_file="{tmp_path}"')
    assert 'inference.api_key_env = "KEY" cannot be set with inference.api_key_file' in both
    named = config_problem('inference.api_key_env="NOT A NAME"')
    assert 'inference.api_key_env = "NOT A NAME" is not an environment variable\'s name' in named


def test_a_401_says_whether_a_token_was_sent() -> None:
    assert unauthorized_detail("http://h:1", sent_token=False).startswith(
        "the server wants a bearer token: set [inference] api_key_env or api_key_file"
    )
    assert unauthorized_detail("http://h:1", sent_token=True).startswith(
        "the server refused the bearer token"
    )


async def test_both_clients_carry_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCH_TEST_KEY", TOKEN)
    token = load_bearer_token(InferenceConfig(api_key_env="ORCH_TEST_KEY"))
    async with open_clients(
        4, max_reply_bytes=1024, max_buffered_reply_bytes=4096, token=token
    ) as c:
        assert c.generate.authorization == f"Bearer {TOKEN}"
        assert c.control.authorization == f"Bearer {TOKEN}"
        assert TOKEN not in repr(c.generate) and TOKEN not in repr(c.control)
    async with open_clients(4, max_reply_bytes=1024, max_buffered_reply_bytes=4096) as c:
        assert c.generate.authorization is None
        assert c.control.authorization is None

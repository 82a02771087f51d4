"""Servers closed with a bearer token, as `vllm serve --api-key` closes them: the daemon
trains against them with the token from `[inference] api_key_file` (or `api_key_env`),
names a missing or wrong token in one failure line, and never shows the token: not in
the logs, not in `progress.json`, not in `check-config`'s output. A token that cannot be
read stops `run` before the payload root is touched."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import httpx
import pytest
import structlog.testing
import trio
from cli_kit import ORCHESTRATOR, config_args, refused, run_cli

from orchestrator.commands.launch import launch_run
from orchestrator.config import Config, load_config
from orchestrator.daemon.run_state import RunState
from orchestrator.sim import serve_inference
from orchestrator.sim.fleet import sim_inference_config

SIM = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"
TOKEN = "sk-closed-0c4f1e"
STEPS = 3


def run_config(run_dir: Path, *more: str) -> Config:
    return load_config(
        SIM,
        [
            f'run_dir="{run_dir}"',
            f"max_steps={STEPS}",
            "sim.inference_servers=0",
            "sim.train_time_s=0.02",
            "trainer.poll_interval_s=0.1",
            *more,
        ],
    )


@pytest.fixture
async def closed_server(tmp_path: Path) -> AsyncIterator[str]:
    """A local server (by handle, prime-rl's form) that wants `TOKEN`."""
    fleet = load_config(SIM, [f'run_dir="{tmp_path}"'])
    config = attrs.evolve(sim_inference_config(fleet, 0), api_key=TOKEN)
    async with trio.open_nursery() as nursery:
        yield await nursery.start(serve_inference, config)
        nursery.cancel_scope.cancel()


async def test_the_local_server_guards_what_vllm_guards(closed_server: str) -> None:
    async with httpx.AsyncClient() as client:
        body = {"request_id": "r", "token_ids": [1, 2], "sampling_params": {"max_tokens": 2}}
        refused = await client.post(f"{closed_server}/inference/v1/generate", json=body)
        assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
        wrong = await client.post(
            f"{closed_server}/inference/v1/generate",
            json=body,
            headers={"authorization": "Bearer sk-other"},
        )
        assert wrong.status_code == 401
        taken = await client.post(
            f"{closed_server}/inference/v1/generate",
            json=body,
            headers={"authorization": f"bearer {TOKEN}"},  # the scheme in any case, as vLLM
        )
        assert taken.status_code == 200
        assert (await client.get(f"{closed_server}/health")).status_code == 200


def written_text(run_dir: Path) -> str:
    return "\n".join(
        path.read_text(errors="replace")
        for path in run_dir.rglob("*")
        if path.is_file() and path.suffix in (".json", ".jsonl", ".toml", ".log")
    )


async def test_a_run_trains_against_closed_servers_and_never_shows_the_token(
    closed_server: str, tmp_path: Path
) -> None:
    key = tmp_path / "api-key"
    key.write_text(TOKEN + "\n")
    config = run_config(
        tmp_path / "run", f'inference.urls=["{closed_server}"]', f'inference.api_key_file="{key}"'
    )
    with structlog.testing.capture_logs() as logs, trio.fail_after(120):
        outcome = await launch_run(config)
    assert outcome.state.shipping.next_step == STEPS + 1
    assert outcome.state.dispatch.failures["unauthorized"] == 0
    assert TOKEN not in repr(logs)
    progress = (config.state_dir / "progress.json").read_text()
    assert TOKEN not in progress and TOKEN not in written_text(config.run_dir)


async def first_failures(config: Config) -> list[tuple[str, int]]:
    """The run's most common "unauthorized" texts once it has some."""
    async with trio.open_nursery() as nursery:
        state: RunState = await nursery.start(launch_run, config)
        with trio.fail_after(30):
            while state.dispatch.failures["unauthorized"] < 4:
                await state.wait_changed()
        nursery.cancel_scope.cancel()
    assert state.shipping.next_step == 1
    return state.dispatch.rejections.most_common("unauthorized")


async def test_a_missing_token_is_named_with_the_keys_that_set_it(
    closed_server: str, tmp_path: Path
) -> None:
    config = run_config(tmp_path / "run", f'inference.urls=["{closed_server}"]')
    ((text, _),) = await first_failures(config)
    assert text.startswith(
        "the server wants a bearer token: set [inference] api_key_env or api_key_file"
    ), text


async def test_a_wrong_token_is_named_as_refused(
    closed_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ORCH_CLOSED_KEY", "sk-not-the-servers")
    config = run_config(
        tmp_path / "run",
        f'inference.urls=["{closed_server}"]',
        'inference.api_key_env="ORCH_CLOSED_KEY"',
    )
    with structlog.testing.capture_logs() as logs:
        ((text, _),) = await first_failures(config)
    assert text.startswith("the server refused the bearer token"), text
    assert "sk-not-the-servers" not in repr(logs)


def test_check_config_says_where_the_token_is_and_not_what_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("ORCH_CLOSED_KEY", TOKEN)
    sets = (f'run_dir="{tmp_path}"', 'inference.api_key_env="ORCH_CLOSED_KEY"')
    code, out, _ = run_cli(capsys, "check-config", *config_args(SIM, *sets, positional=True))
    assert code == 0
    assert '#   bearer token: read from inference.api_key_env = "ORCH_CLOSED_KEY"' in out
    assert 'api_key_env = "ORCH_CLOSED_KEY"' in out
    assert TOKEN not in out


@pytest.mark.parametrize("command", ["check-config", "run"])
def test_a_token_that_cannot_be_read_is_one_line_and_touches_nothing(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    kept = run_dir / "payloads" / "v0" / "kept.bin"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"payload")
    absent = tmp_path / "no-key"
    sets = [f'run_dir="{run_dir}"', f'inference.api_key_file="{absent}"']
    args = config_args(SIM, *sets, positional=command == "check-config")
    assert refused(capsys, command, *args) == (
        f"orchestrator {command}: error: inference.api_key_file = "
        f'"{absent}": cannot read it: No such file or directory\n'
    )
    assert kept.read_bytes() == b"payload"
    assert not (load_config(SIM, sets).state_dir / "progress.json").exists()


async def test_a_fleet_that_refuses_everything_stops_the_run_instead_of_retrying_for_ever(
    closed_server: str, tmp_path: Path
) -> None:
    # No token: every request is refused with the same 401. Once the whole fleet has
    # refused everything for `refusal_stop_s`, the run stops as if asked, and says why.
    config = run_config(
        tmp_path / "run", f'inference.urls=["{closed_server}"]', "inference.refusal_stop_s=1.0"
    )
    with structlog.testing.capture_logs() as logs, trio.fail_after(60):
        outcome = await launch_run(config)
    halt = outcome.state.dispatch.halt_reason
    assert outcome.stopped and halt is not None and halt.by == "refused"
    refused = halt.line
    assert refused.startswith("error: every inference server refused every request for 1 s")
    assert "the server wants a bearer token: set [inference] api_key_env or api_key_file" in refused
    assert outcome.state.shipping.next_step == 1
    # It stopped within about a second of refusals, not after thousands of them.
    assert outcome.state.dispatch.failures["unauthorized"] < 2000
    assert [e["event"] for e in logs if e["log_level"] == "error"] == [
        "the fleet refuses every request: ending the run"
    ]


async def test_run_ends_a_refused_fleet_with_exit_2_and_one_line(
    closed_server: str, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    sets = [
        f'run_dir="{run_dir}"',
        f'inference.urls=["{closed_server}"]',
        "inference.refusal_stop_s=1.0",
        f"max_steps={STEPS}",
        "sim.inference_servers=0",
        "sim.trainer=false",
    ]
    command = [*ORCHESTRATOR, "run", *config_args(SIM, *sets)]
    with trio.fail_after(90):
        done = await trio.run_process(
            command, capture_stdout=True, capture_stderr=True, check=False
        )
    err = done.stderr.decode()
    assert done.returncode == 2, err[-3000:]
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith(
        "orchestrator run: error: every inference server refused every request for "
    ), last
    assert last.endswith(f"{closed_server}: HTTP 401"), last
    # Stopped as if asked: the summary was printed and the progress saved for a resume.
    assert "== run summary ==" in err
    assert any(run_dir.rglob("progress.json"))

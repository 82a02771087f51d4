"""`check-config --probe` (issue 55, finding 5): each `[inference] urls` server asked for
`/health` and `/v1/models` before the run, one line per server; exit 2 when one is
unreachable or serves another model. Real local servers on loopback, and a port that
nobody listens on."""

from __future__ import annotations

import socket
from pathlib import Path

import attrs
import pytest
import trio
from cli_kit import run_cli

from orchestrator.commands.probe import judge
from orchestrator.config import Config, SimConfig
from orchestrator.sim import serve_inference
from orchestrator.sim.fleet import sim_inference_config


def closed_port() -> str:
    """A loopback URL nobody listens on (a port bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def write_config(tmp_path: Path, urls: list[str], model: str) -> Path:
    path = tmp_path / "probe.toml"
    listed = ", ".join(f'"{url}"' for url in urls)
    path.write_text(
        f'run_dir = "{tmp_path / "run"}"\n[inference]\nurls = [{listed}]\nmodel = "{model}"\n'
    )
    return path


async def test_probe_says_what_each_server_answered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = Config(run_dir=tmp_path / "fleet", sim=SimConfig(inference_servers=1))
    serving = attrs.evolve(sim_inference_config(fleet, 0), served_model_name="qwen3")
    other = attrs.evolve(sim_inference_config(fleet, 1), served_model_name="llama")
    async with trio.open_nursery() as nursery:
        right = str(await nursery.start(serve_inference, serving))
        wrong = str(await nursery.start(serve_inference, other))
        down = closed_port()

        good = write_config(tmp_path, [right], "qwen3")
        code, out, err = await trio.to_thread.run_sync(
            run_cli, capsys, "check-config", str(good), "--probe"
        )
        assert code == 0, err
        assert err == f"probe {right}: up, serves 'qwen3', holds weights version 0\n"
        assert "# Resolved config" in out, out[:300]

        bad = write_config(tmp_path, [right, wrong, down], "qwen3")
        code, out, err = await trio.to_thread.run_sync(
            run_cli, capsys, "check-config", str(bad), "--probe"
        )
        nursery.cancel_scope.cancel()
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert lines == [
        f"probe {right}: up, serves 'qwen3', holds weights version 0",
        f"orchestrator check-config: error: probe {wrong}: up, serves 'llama', "
        "not [inference] model = 'qwen3'",
        f"orchestrator check-config: error: probe {down}: unreachable: connection refused",
    ]


def test_a_fresh_run_against_a_server_holding_other_weights_is_refused() -> None:
    models = b'{"object": "list", "data": [{"id": "qwen3"}]}'
    held = judge("http://s:1", 4, 200, models, model="qwen3", fresh=True)
    assert not held.ok
    assert "holds weights version 4: a fresh run takes the servers to hold version 0" in held.line
    # Resuming, or a server that says nothing of its weights (upstream vLLM): fine.
    assert judge("http://s:1", 4, 200, models, model="qwen3", fresh=False).ok
    assert judge("http://s:1", None, 200, models, model="qwen3", fresh=True).ok
    # No /v1/models: up, its model unknown.
    unknown = judge("http://s:1", None, 404, b"", model="qwen3", fresh=True)
    assert unknown.ok and "its model is not known" in unknown.line

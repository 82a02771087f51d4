"""A server that ignores `n`: a group's first turn asks for `group_size` choices in one
request (`inference.group_request`), and a server built on prime-rl's writer functions,
or a proxy that drops `n`, answers one. That once failed every group on it as
"malformed", for ever. Against two real loopback servers, one of which answers one
choice whatever `n` asks: the daemon says so once, naming the server and
`inference.group_request`, keeps the choice it got, sends every other rollout of that
server its own first request from then on, keeps group requests on the other server,
and the run trains to its end without a failure."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import structlog.testing
import trio

from orchestrator.commands.launch import launch_run
from orchestrator.config import load_config
from orchestrator.sim import serve_inference
from orchestrator.sim.fleet import sim_inference_config

SIM = Path(__file__).resolve().parents[2] / "configs" / "sim.toml"
STEPS = 3
ROLLOUTS_OWN = re.compile(r"-r\d+-t0$")


async def test_a_server_that_ignores_n_gets_a_request_per_rollout_and_the_run_trains(
    tmp_path: Path,
) -> None:
    fleet = load_config(SIM, [f'run_dir="{tmp_path}"'])
    async with trio.open_nursery() as nursery:
        ignoring = await nursery.start(
            serve_inference, attrs.evolve(sim_inference_config(fleet, 0), ignores_n=True)
        )
        honest = await nursery.start(serve_inference, sim_inference_config(fleet, 1))
        config = load_config(
            SIM,
            [
                f'run_dir="{tmp_path / "run"}"',
                f"max_steps={STEPS}",
                "sim.inference_servers=0",
                "sim.train_time_s=0.02",
                "trainer.poll_interval_s=0.1",
                f'inference.urls=["{ignoring}", "{honest}"]',
                "inference.group_request=true",
                "batch.group_size=4",
            ],
        )
        with structlog.testing.capture_logs() as logs, trio.fail_after(120):
            outcome = await launch_run(config)
        nursery.cancel_scope.cancel()

    state = outcome.state
    assert state.shipping.last_shipped == STEPS
    # Not one rollout failed: the group that met it kept its choice, the others asked alone.
    assert state.dispatch.failures["malformed"] == 0, state.dispatch.rejections.texts()
    assert state.dispatch.rollouts["failed"] == 0
    said = [e for e in logs if e["event"] == "inference server ignores n"]
    assert len(said) == 1, said
    assert said[0]["log_level"] == "warning"
    assert said[0]["url"] == ignoring and (said[0]["asked"], said[0]["answered"]) == (4, 1)
    assert "inference.group_request" in said[0]["now"]
    # The servers log each request they answer (`generated`, at debug level): a group's
    # request is `<group>-t0`, a rollout's own first request `<group>-r<i>-t0`.
    generated = [e for e in logs if e["event"] == "generated"]
    firsts = [e for e in generated if e["request_id"].endswith("-t0")]
    alone = [e for e in firsts if ROLLOUTS_OWN.search(e["request_id"])]
    cut_short = [e for e in firsts if e not in alone and e["choices"] == 1]
    # The other server still answers group requests, with a choice for each rollout.
    assert [e for e in firsts if e["choices"] == 4]
    # Only the groups already in flight when the first short reply came sent that server
    # a group request (their members without a choice then asked alone); every later
    # group of that server sent a request per rollout.
    assert 1 <= len(cut_short) <= config.inference.max_inflight // 4, len(cut_short)
    assert len(alone) > 3 * len(cut_short), (len(alone), len(cut_short))

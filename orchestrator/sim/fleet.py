"""The embedded fleet of a run: the local servers and trainer its config asks for.

`orchestrator run` starts `serve_local_fleet` beside the daemon: `[sim] inference_servers`
servers and, with `[sim] trainer = true`, the local trainer; the daemon is given the
servers' URLs. Tests that run them as separate processes use the `sim-inference` and
`sim-trainer` commands, which build the same settings. The servers' vocabulary and eos
id follow the `[model]` tokenizer the run's real tasks loaded (`model_tokens`: its size
and end-of-turn id) unless `[sim]` sets them (`SimConfig.tokens`).
"""

from __future__ import annotations

import trio

from orchestrator.config import Config
from orchestrator.handoff.trainer_report import REPORT_PATH
from orchestrator.sim import FaultRates, SimInferenceConfig, SimModel
from orchestrator.sim.inference import DEFAULT_SERVED_MODEL_NAME, serve_inference
from orchestrator.sim.trainer import SimTrainerConfig, serve_trainer


async def serve_local_fleet(
    config: Config,
    model_tokens: tuple[int, int] | None = None,
    *,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the servers and the trainer `config`'s `[sim]` section asks for until
    cancelled; reports the servers' URLs (none when it asks for no server) once all of
    them listen."""
    async with trio.open_nursery() as nursery:
        urls = [
            str(
                await nursery.start(
                    serve_inference, sim_inference_config(config, index, model_tokens=model_tokens)
                )
            )
            for index in range(config.sim.inference_servers)
        ]
        if config.sim.trainer:
            await nursery.start(serve_trainer, sim_trainer_config(config))
        task_status.started(urls)
        await trio.sleep_forever()


def sim_model(config: Config, model_tokens: tuple[int, int] | None = None) -> SimModel:
    """Every server of the fleet runs the same model (one policy, one routing function),
    its vocabulary and eos id `SimConfig.tokens(model_tokens)`."""
    vocab_size, eos_token_id = config.sim.tokens(model_tokens)
    return SimModel(
        layers=config.sim.layers,
        num_experts=config.sim.num_experts,
        top_k=config.sim.top_k,
        vocab_size=vocab_size,
        eos_token_id=eos_token_id,
    )


def sim_inference_config(
    config: Config, index: int, *, port: int = 0, model_tokens: tuple[int, int] | None = None
) -> SimInferenceConfig:
    """Server `index` of the fleet; each draws its faults from its own seed. It serves
    the model under `[inference] model` when set (the name the daemon sends), so the
    name check is exercised, else under the simulator's default name. With `[inference]
    disaggregated = true` each server is a P/D deployment: a router in front of a prefill
    and a decode server, both with these settings (orchestrator.sim.pd_router)."""
    sim = config.sim
    return SimInferenceConfig(
        model=sim_model(config, model_tokens),
        served_model_name=config.inference.model or DEFAULT_SERVED_MODEL_NAME,
        port=port,
        reply_form=sim.reply_form,
        capture_routed_experts=sim.capture_routed_experts,
        capture_sampling_mask=sim.capture_sampling_mask,
        payload_digests=sim.payload_digests,
        time_per_token_s=sim.time_per_token_s,
        max_num_seqs=sim.max_num_seqs,
        faults=FaultRates(
            http_500=sim.http_500_rate,
            hang=sim.hang_rate,
            malformed=sim.malformed_rate,
            bad_segment=sim.bad_segment_rate,
            payload_error=sim.payload_error_rate,
        ),
        fault_seed=abs(sim.fault_seed) * 1000 + index,
        fsync=config.payload.fsync,
        disaggregated=config.inference.disaggregated,
        vllm_version=config.sim.vllm_version,
    )


def sim_trainer_config(config: Config) -> SimTrainerConfig:
    """The local trainer: reads every batch's payloads (verifying digests), then publishes."""
    return SimTrainerConfig(
        batches_dir=config.batches_dir,
        weights_dir=config.weights_dir,
        train_time_s=config.sim.train_time_s,
        max_steps=config.max_steps,
        force_polling=config.trainer.force_polling,
        poll_interval_s=config.trainer.poll_interval_s,
        weights_layout=config.trainer.weights_layout,
        format=config.trainer.format,
        data_world_size=config.trainer.data_world_size,
        verify=True,
        report_path=config.run_dir / REPORT_PATH,
        checkpoint_base=config.sim.trainer_checkpoint,
    )

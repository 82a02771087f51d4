"""The values the core and the services are built from, read off the config once."""

from __future__ import annotations

from orchestrator.config import Config
from orchestrator.core.inflight import InflightLimit
from orchestrator.core.sink import SinkLimits
from orchestrator.daemon.inference.server_pool import ProbeSettings


def inflight_limit(config: Config) -> InflightLimit:
    """The in-flight limit of `config`'s run: adaptive or fixed, below `max_inflight`."""
    return InflightLimit(
        config.inference.inflight_limit,
        ceiling=config.inference.max_inflight,
        group_size=config.batch.group_size,
    )


def sink_limits(config: Config) -> SinkLimits:
    return SinkLimits(
        batch_size=config.batch.size,
        constant_size=config.batch.constant_size,
        staleness=config.staleness,
        curriculum_min_mean_reward=config.batch.curriculum_min_mean_reward,
        curriculum_max_mean_reward=config.batch.curriculum_max_mean_reward,
        max_seq_len=config.batch.max_seq_len,
    )


def probe_settings(config: Config) -> ProbeSettings:
    return ProbeSettings(
        weights_dir=config.weights_dir,
        weights_layout=config.trainer.weights_layout,
        interval_s=min(1.0, config.inference.unavailable_deadline_s / 3),
        request_timeout_s=min(5.0, config.inference.request_timeout_s),
        unavailable_deadline_s=config.inference.unavailable_deadline_s,
        weight_update=config.inference.weight_update,
        load_timeout_s=config.inference.request_timeout_s,
    )

"""The workload of the real-scale benchmark: its targets, its rollouts and its fleet, and
the config overrides that ask the daemon for them."""

from __future__ import annotations

from system_fleet import ModelShape

TARGET_WORST_LAG_S = 0.020
TARGET_BYTES_PER_TOKEN = 16.0
TARGET_WRITE_S_PER_MTOK = 0.2
TARGET_READ_S_PER_MTOK = 0.1

SIZES = (256, 512)
GROUP_SIZE = 8
PROMPT_MIN, PROMPT_MAX = 3_900, 4_100
# The simulated model stops at a length drawn from [max_tokens / 8, 1.5 max_tokens]
# (capped at max_tokens): 0.72 max_tokens on average, ~505 tokens here.
MAX_TOKENS = 700
SHAPE = ModelShape(layers=1, top_k=8, num_experts=128)
SERVERS = 2
MAX_INFLIGHT = 64
FINE_LAG_INTERVAL_S = 0.001
# How often the benchmark looks at the run (RSS, shipped batches) from the daemon's loop.
POLL_S = 0.25
REPEATS = 5
TOP_FUNCTIONS = 8
TRAINER_GRACE_S = 60.0
PROFILE_STEPS = 3
# Task steps at least this long are kept with where they suspended.
LONG_STEP_S = 0.005


def workload_overrides(size: int, steps: int) -> list[str]:
    return [
        f"max_steps={steps}",
        'sim.env="math"',
        f"sim.prompt_len_min={PROMPT_MIN}",
        f"sim.prompt_len_max={PROMPT_MAX}",
        f"sim.max_tokens={MAX_TOKENS}",
        "sim.max_turns=1",
        # Keep every group with a learning signal: fewer rollouts thrown away per batch.
        "batch.curriculum_min_mean_reward=0.0",
        f"batch.size={size}",
        f"batch.group_size={GROUP_SIZE}",
        "batch.max_seq_len=8192",
        f"inference.max_inflight={MAX_INFLIGHT}",
        "staleness.max_off_policy_steps=2",
        "staleness.max_async_steps=1",
        'payload.mode="by_handle"',
        "sim.train_time_s=0.0",
        "trainer.poll_interval_s=0.05",
        'metrics.listen="127.0.0.1:0"',
    ]

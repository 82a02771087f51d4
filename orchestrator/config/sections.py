"""The config's shape: frozen sections with their checks, and the values derived from them.

Each section validates its own keys (attrs validators raising InvalidValue); `Config`
checks the rules that span sections when it is built. The derived values (resolved
directories, whether payloads travel by handle) are properties, computed from the fields.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import attrs

from orchestrator.config.checks import (
    at_least,
    dangerous_root_problem,
    distinct_items,
    fraction,
    greater_than,
    http_urls,
    listen_address,
    not_above_sibling,
    not_below_sibling,
    one_of,
)
from orchestrator.config.errors import InvalidValue
from orchestrator.config.reply_limits import (
    ModelShape,
    derived_max_buffered_reply_bytes,
    derived_max_reply_bytes,
)
from orchestrator.core.environments import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, DEFAULT_TOP_P
from orchestrator.core.inflight import INFLIGHT_MODES, InflightMode
from orchestrator.core.staleness import Staleness
from orchestrator.handoff import (
    STEP_LAYOUTS,
    HandoffFormat,
    HandoffSettings,
    StepLayout,
    format_names,
    handoff_format,
)
from orchestrator.payload import RoutingShape
from orchestrator.reply_form_names import DEFAULT_REPLY_FORM, REPLY_FORM_NAMES, ReplyFormName
from orchestrator.wire import WEIGHT_UPDATES, WeightUpdate

PayloadMode = Literal["auto", "by_handle", "inline"]
PayloadField = Literal["routed_experts", "sampling_mask"]
FinalTokenRoute = Literal["repeat", "sentinel"]
# The simulator's toy environments (`[sim] env`): random token ids scored by a hash.
ToyEnvName = Literal["mixed", "math", "chat"]
# How the trainer names its weights' step directories.
WeightsLayout = StepLayout

# Every local inference server listens on loopback, so together they are one host.
LOCAL_HOST = "127.0.0.1"
#: What the local fleet's `GET /version` answers unless `[sim] vllm_version` says: no
#: release of vLLM, so none of `orchestrator.wire.MOE_RELOAD_BROKEN`.
SIM_VLLM_VERSION = "0.0.0+sim"


def _absolute_path(value: str | os.PathLike[str]) -> Path:
    """`value` made absolute against the current directory, `~` expanded, `..` folded.

    Symbolic links are deliberately not resolved: the collector must see (and refuse) a
    linked payload root, not the directory it points to.
    """
    path = Path(value).expanduser()
    return Path(os.path.normpath(Path.cwd() / path))


def _optional_absolute_path(value: str | os.PathLike[str] | None) -> Path | None:
    return None if value is None else _absolute_path(value)


def _is_within(path: Path, directory: Path) -> bool:
    """Whether `path` is `directory` or below it (both absolute and normalised)."""
    return path == directory or directory in path.parents


@attrs.frozen
class StalenessConfig(Staleness):
    """How far behind the trainer's policy a rollout may be: the core's `Staleness`, with
    the config's checks (docs/design.md §3)."""

    max_off_policy_steps: int = attrs.field(default=2, validator=at_least(0))
    max_async_steps: int = attrs.field(default=1, validator=at_least(0))

    def __attrs_post_init__(self) -> None:
        # The core's rule, reported under the config's key.
        problem = self.limits_problem()
        if problem is not None:
            raise InvalidValue(
                f"must be <= {{0}} ({self.max_off_policy_steps}): {problem}",
                value=self.max_async_steps,
                key="max_async_steps",
                siblings=["max_off_policy_steps"],
            )


@attrs.frozen
class BatchConfig:
    """The shape of the batches shipped to the trainer."""

    # Samples per batch.
    size: int = attrs.field(default=64, validator=at_least(1))
    # Rollouts per prompt. GRPO scores each rollout against its group's mean, so a group
    # of one has an advantage of zero everywhere: the run would never learn anything.
    group_size: int = attrs.field(
        default=8,
        validator=at_least(
            2, "a group of one rollout has no learning signal (its advantages are all zero)"
        ),
    )
    # Ship exactly `size` samples, pruning the excess (discard reason "pruned").
    constant_size: bool = True
    max_seq_len: int = attrs.field(default=8192, validator=at_least(2))
    # A group whose mean reward falls outside [min, max] is discarded ("curriculum").
    curriculum_min_mean_reward: float = 0.0
    curriculum_max_mean_reward: float = attrs.field(
        default=1.0, validator=not_below_sibling("curriculum_min_mean_reward")
    )


@attrs.frozen
class PayloadConfig:
    """Router-replay payloads: how they travel and where their files live."""

    mode: PayloadMode = "auto"
    # None: <run_dir>/payloads (see Config.payload_root).
    root: Path | None = attrs.field(default=None, converter=_optional_absolute_path)
    fields: tuple[PayloadField, ...] = attrs.field(
        default=("routed_experts", "sampling_mask"), validator=distinct_items
    )
    final_token_route: FinalTokenRoute = "repeat"
    fsync: bool = False
    # The model's routing shape: every routing row a server sends must be [layers, top_k],
    # with ids below num_experts. 0 leaves it to the local fleet's model ([sim]) or, with
    # real servers, to the first reply of the run that carries routing.
    layers: int = attrs.field(default=0, validator=at_least(0))
    top_k: int = attrs.field(default=0, validator=at_least(0))
    num_experts: int = attrs.field(default=0, validator=at_least(0))


_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _variable_name(instance: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value and not _VARIABLE_NAME.fullmatch(value):
        raise InvalidValue(
            "is not an environment variable's name (letters, digits and _)",
            value=value,
            key=attribute.name,
        )


@attrs.frozen
class InferenceConfig:
    """The inference servers the daemon sends rollouts to."""

    urls: tuple[str, ...] = attrs.field(default=(), validator=[http_urls, distinct_items])
    # The served model name sent as each request's `model` (vLLM checks it); "" sends none.
    model: str = ""
    # The most rollouts in flight at once: the fixed limit, or the adaptive one's ceiling.
    max_inflight: int = attrs.field(default=64, validator=at_least(1))
    # "adaptive": dispatch only what can finish fresh, learned from group turnaround and
    # step time (orchestrator/core/inflight.py); "fixed": always max_inflight.
    inflight_limit: InflightMode = attrs.field(default="adaptive", validator=one_of(INFLIGHT_MODES))
    # How a server is told to load a new policy version (orchestrator/wire/weight_updates.py):
    # "prime-rl" (its /update_weights), "vllm" (upstream vLLM's dev-mode endpoints: pause,
    # reload_weights from the version's checkpoint, resume; VLLM_SERVER_DEV_MODE=1), or
    # "none" (the trainer pushes weights itself; the daemon only follows the versions).
    weight_update: WeightUpdate = attrs.field(default="prime-rl", validator=one_of(WEIGHT_UPDATES))
    request_timeout_s: float = attrs.field(default=600.0, validator=greater_than(0))
    retries: int = attrs.field(default=3, validator=at_least(0))
    retry_backoff_s: float = attrs.field(default=0.5, validator=at_least(0))
    # Every server unreachable for this long is fatal: the run stops with an error.
    unavailable_deadline_s: float = attrs.field(default=300.0, validator=greater_than(0))
    # Every server refusing every request with the same client error (4xx, 401) for this
    # long (and 10 requests) ends the run, exit status 2, that error in one line
    # (orchestrator/core/refusals.py); 0: never.
    refusal_stop_s: float = attrs.field(default=30.0, validator=at_least(0))
    # Prefill and decode on different servers behind a router (each URL is a router). With
    # local servers ([sim] inference_servers), each is such a deployment.
    disaggregated: bool = False
    # A group's first turn as one generate request for all its rollouts
    # (`sampling_params.n` = group_size; vLLM seeds choice i with the request's seed + i),
    # not one request each; each rollout's later turns are its own requests. Not with
    # `disaggregated`, nor for environments that drive their own turns (`group_requests`).
    group_request: bool = True
    multi_node: bool = False
    # Bytes of one generate reply read before it is refused ("oversized"); 0 derives the
    # cap from the payload mode (Config.max_reply_bytes, orchestrator.config.reply_limits).
    max_reply_bytes: int = attrs.field(default=0, validator=at_least(0))
    # Bytes all in-flight generate replies may hold together; 0 derives it.
    max_buffered_reply_bytes: int = attrs.field(default=0, validator=at_least(0))
    # The bearer token servers started with `vllm serve --api-key` want, sent as
    # `Authorization: Bearer` with every request: the name of an environment variable that
    # holds it, or a file that holds it (one of the two). The token itself is never in the
    # config, the logs or progress.json (orchestrator/daemon/inference/credentials.py).
    api_key_env: str = attrs.field(default="", validator=_variable_name)
    api_key_file: Path | None = attrs.field(default=None, converter=_optional_absolute_path)

    def __attrs_post_init__(self) -> None:
        if self.api_key_env and self.api_key_file is not None:
            raise InvalidValue(
                "cannot be set with {0}: say where the token is once",
                value=self.api_key_env,
                key="api_key_env",
                siblings=["api_key_file"],
            )


def _registered_format(instance: object, attribute: attrs.Attribute[Any], value: str) -> None:
    # The registry is read when a config is built, not when this module is imported.
    one_of(format_names())(instance, attribute, value)


@attrs.frozen
class TrainerConfig:
    """The file hand-off with the trainer (docs/design.md §5)."""

    # None: <run_dir>/batches and <run_dir>/weights (see Config.batches_dir/weights_dir).
    # With prime-rl's trainer (format = "prime-rl"): batches_dir is its
    # <output_dir>/rollouts and weights_dir its <output_dir>/broadcasts.
    batches_dir: Path | None = attrs.field(default=None, converter=_optional_absolute_path)
    weights_dir: Path | None = attrs.field(default=None, converter=_optional_absolute_path)
    # What the daemon ships: "native" is ours, step_000007/batch.bin; "prime-rl" is what
    # prime-rl's trainer reads, step_7/rank_R.bin per data rank (msgpack micro batches).
    # Any format in orchestrator.handoff's registry.
    format: str = attrs.field(default="native", validator=_registered_format)
    # prime-rl format: the trainer's data-parallel ranks, one rank_R.bin each.
    data_world_size: int = attrs.field(default=1, validator=at_least(1))
    # prime-rl format: tokens per micro batch (the trainer's seq_len); 0 is batch.max_seq_len.
    seq_len: int = attrs.field(default=0, validator=at_least(0))
    # inotify does not see writes made on other hosts, so NFS needs polling.
    force_polling: bool = False
    poll_interval_s: float = attrs.field(default=1.0, validator=greater_than(0))
    # How the trainer names a version's directory: "native" is ours, step_000007/STABLE;
    # "prime-rl" is prime-rl's step_7/STABLE (point weights_dir at its broadcasts/).
    weights_layout: WeightsLayout = attrs.field(default="native", validator=one_of(STEP_LAYOUTS))


@attrs.frozen
class ModelConfig:
    """The model the servers run: its folder (the reference trainer's starting weights)
    and its tokenizer (the daemon's), which is the folder's unless said otherwise."""

    # A local Hugging Face folder of the model: config.json, safetensors weights and the
    # tokenizer files. The reference trainer (`orchestrator-trainer`) starts from it; the
    # daemon reads only its tokenizer, and only when `tokenizer` is not set.
    path: Path | None = attrs.field(default=None, converter=_optional_absolute_path)
    # A local folder with the model's tokenizer files (tokenizer.json, tokenizer_config.json
    # with its chat template). Nothing is ever downloaded. Required by every [[env]];
    # defaults to `path`.
    tokenizer: Path | None = attrs.field(default=None, converter=_optional_absolute_path)
    # Extra variables for the chat template, as vLLM's `chat_template_kwargs` request field
    # and `apply_chat_template(**kwargs)` take them: `{enable_thinking = false}` for Qwen3.
    chat_template_kwargs: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.tokenizer is None and self.path is not None:
            # Frozen: the one place the default is resolved, so every reader sees it.
            object.__setattr__(self, "tokenizer", self.path)


AutocastName = Literal["none", "bfloat16"]
AUTOCASTS: tuple[AutocastName, ...] = ("none", "bfloat16")


@attrs.frozen
class TrainConfig:
    """The reference trainer's own keys (`orchestrator-trainer`, docs/operations.md §
    The reference trainer). The daemon reads none of them; they live in the run's config
    so that one file describes the run and `check-config` checks them."""

    # AdamW's learning rate, weight decay and betas.
    learning_rate: float = attrs.field(default=1e-6, validator=greater_than(0))
    weight_decay: float = attrs.field(default=0.0, validator=at_least(0))
    adam_beta1: float = attrs.field(default=0.9, validator=fraction)
    adam_beta2: float = attrs.field(default=0.999, validator=fraction)
    # Gradients are clipped to this global norm (0: not clipped).
    max_grad_norm: float = attrs.field(default=1.0, validator=at_least(0))
    # The trust region of prime-rl's default loss: a token whose probability under the
    # trainer moved more than this above (for a positive advantage) or below (negative)
    # its probability at inference is masked out of the policy gradient.
    mask_high: float = attrs.field(default=0.2, validator=at_least(0))
    mask_low: float = attrs.field(default=0.2, validator=at_least(0))
    # Weight of the squared log importance ratio added to the loss (prime-rl's kl_tau).
    kl_coef: float = attrs.field(default=1e-3, validator=at_least(0))
    # Replay the routed experts the batch carries in every MoE layer (Qwen3-MoE).
    router_replay: bool = True
    # Measure the on-policy mismatch KL without replay too: one more forward per step.
    mismatch_without_replay: bool = False
    # An on-policy mismatch KL above this says, in one warning line, which version and
    # server it came from: same weights on both sides stay far below it (1e-13 in float32
    # on the CPU; 7e-5 from a bfloat16 server with replay), while a server that kept an
    # earlier version's weights measured 0.6 and more.
    mismatch_warn_kl: float = attrs.field(default=0.01, validator=greater_than(0))
    # Train only the top this many decoder layers (and the final norm); the embeddings
    # and the layers below are frozen, which cuts the backward and the optimizer to
    # their share. 0: the whole model.
    trained_layers: int = attrs.field(default=0, validator=at_least(0))
    # "bfloat16": the forward and backward under CPU/CUDA autocast in bfloat16 (weights,
    # gradients and optimizer stay in the checkpoint's dtype); "none": the checkpoint's.
    autocast: AutocastName = attrs.field(default="none", validator=one_of(AUTOCASTS))
    # Samples packed by length into micro-batches of at most this many padded tokens,
    # one forward and backward each; 0 (or a model whose routes are replayed): one
    # sample per forward.
    micro_batch_tokens: int = attrs.field(default=0, validator=at_least(0))


RewardExecutorName = Literal["process", "ray"]


@attrs.frozen
class RewardsConfig:
    """Where reward functions run: worker processes on this machine, or tasks on a Ray
    cluster (docs/design.md § Rewards beyond one machine)."""

    # "process": worker processes on this machine; "ray": tasks on a Ray cluster (the
    # optional extra: pip install 'rollout-orchestrator[ray]').
    executor: RewardExecutorName = "process"
    # Worker processes (0: one per core of the machine); with Ray, the most calls on the
    # cluster at once (0: the cluster's CPUs).
    workers: int = attrs.field(default=0, validator=at_least(0))
    # The longest one rollout's rewards may take; a call past it is killed ("reward_failed").
    timeout_s: float = attrs.field(default=30.0, validator=greater_than(0))
    # Ray only: the cluster ("auto": the one this machine belongs to; "ray://host:10001":
    # Ray Client; "": a local instance started on this machine, for trying it out), and
    # the runtime environment its tasks get (Ray's own keys, e.g. {working_dir = "."}).
    address: str = ""
    ray_runtime_env: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        if self.executor != "ray" and (self.address or self.ray_runtime_env):
            key = "address" if self.address else "ray_runtime_env"
            raise InvalidValue(
                'is for executor = "ray" only: set it too, or leave this out',
                value=self.address or self.ray_runtime_env,
                key=key,
            )


def _env_name(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not _ENV_NAME.fullmatch(value):
        raise InvalidValue(
            "must be a name of letters, digits, '_', '-' and '.' (it names the env in "
            "batches, logs and metrics)",
            value=value,
            key=attribute.name,
        )


_ENV_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _optional_plugin_id(
    _: object, attribute: attrs.Attribute[str | None], value: str | None
) -> None:
    if value is not None and not _PLUGIN_ID.fullmatch(value):
        raise InvalidValue(
            "must be a verifiers environment's id: the name of an installed package "
            '("my-env", or a hub id "owner/my-env@0.1")',
            value=value,
            key=attribute.name,
        )


# verifiers' plugin ids: a package name, or a hub id `owner/name[@version]`.
_PLUGIN_ID = re.compile(r"(?:[A-Za-z0-9_.-]+/)?[A-Za-z0-9_.-]+(?:@[A-Za-z0-9_.+!-]+)?")


@attrs.frozen
class EnvConfig:
    """One environment of real tasks (`[[env]]`): a dataset of prompts with reward
    functions, a plugin built by a factory (docs/design.md § Real tasks), or an
    environment written for verifiers, run in a worker process of its own
    (docs/operations.md § "Verifiers environments")."""

    name: str = attrs.field(validator=_env_name)
    # A .jsonl file, a .parquet file, or a folder written by `datasets` (save_to_disk).
    dataset: Path | None = attrs.field(default=None, converter=_optional_absolute_path)
    # The column holding the user message as text, or the one holding a chat message list.
    prompt: str | None = None
    messages: str | None = None
    system_prompt: str | None = None
    # The column handed to reward functions as `answer`.
    answer: str | None = None
    # Reward functions as "module:function" import paths, summed with `reward_weights`.
    rewards: tuple[str, ...] = ()
    reward_weights: tuple[float, ...] = ()
    # Share of rollouts drawn from this env when several are listed.
    ratio: float = attrs.field(default=1.0, validator=greater_than(0))
    # Sampling for this env's requests.
    max_tokens: int = attrs.field(default=512, validator=at_least(1))
    temperature: float = attrs.field(default=DEFAULT_TEMPERATURE, validator=at_least(0))
    top_p: float = attrs.field(default=DEFAULT_TOP_P, validator=[greater_than(0), fraction])
    top_k: int = attrs.field(default=DEFAULT_TOP_K, validator=at_least(-1))
    # A plugin environment ("module:function" building it from `args`), and the most
    # turns its episodes may take.
    factory: str | None = None
    args: dict[str, Any] = attrs.field(factory=dict)
    max_turns: int = attrs.field(default=1, validator=at_least(1))
    # A verifiers environment: its taskset's (or environment's) id, an installed package;
    # `args` is then verifiers' own env config (`{taskset = {...}, agent = {...}}`).
    verifiers: str | None = attrs.field(default=None, validator=_optional_plugin_id)
    # A verifiers environment's renderer (renderers' RendererConfig as a table, e.g.
    # {name = "qwen3"}); empty: the tokenizer's own chat template, with
    # `model.chat_template_kwargs` (no tool-call parsing).
    renderer: dict[str, Any] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        sources = [self.dataset, self.factory, self.verifiers]
        if sum(source is not None for source in sources) != 1:
            raise InvalidValue(
                "needs exactly one of dataset (prompts from a dataset, scored by rewards), "
                "factory (a plugin environment) and verifiers (an environment written for "
                "verifiers)",
                value=self.name,
                key="name",
            )
        if self.verifiers is not None:
            self._check_verifiers()
        if self.dataset is not None and (self.prompt is None) == (self.messages is None):
            raise InvalidValue(
                "needs exactly one of prompt (a column of user messages as text) and "
                "messages (a column of chat message lists)",
                value=self.name,
                key="name",
            )
        if self.dataset is not None and not self.rewards:
            raise InvalidValue(
                'must list at least one reward function ("module:function")',
                value=list(self.rewards),
                key="rewards",
            )
        if self.reward_weights and len(self.reward_weights) != len(self.rewards):
            raise InvalidValue(
                f"must have one weight per reward function ({len(self.rewards)}), "
                "or be left out (1 each)",
                value=list(self.reward_weights),
                key="reward_weights",
            )
        if self.args and self.factory is None and self.verifiers is None:
            raise InvalidValue(
                "are the factory's arguments (or a verifiers environment's config): set "
                "factory or verifiers too",
                value=self.args,
                key="args",
            )
        if self.renderer and self.verifiers is None:
            raise InvalidValue(
                "is a verifiers environment's renderer: set verifiers too",
                value=self.renderer,
                key="renderer",
            )

    def _check_verifiers(self) -> None:
        """A verifiers environment has its own tasks and rewards: the dataset's keys and
        reward functions do not apply."""
        for key in ("prompt", "messages", "system_prompt", "answer"):
            value = getattr(self, key)
            if value is not None:
                raise InvalidValue(
                    "is a dataset column: a verifiers environment has its own tasks",
                    value=value,
                    key=key,
                )
        if self.rewards or self.reward_weights:
            key = "rewards" if self.rewards else "reward_weights"
            raise InvalidValue(
                "does not apply: a verifiers environment scores its own episodes (its "
                "@vf.reward functions)",
                value=list(getattr(self, key)),
                key=key,
            )

    @property
    def weights(self) -> tuple[float, ...]:
        """One weight per reward function (1 each when `reward_weights` is left out)."""
        return self.reward_weights or (1.0,) * len(self.rewards)


@attrs.frozen
class EvalConfig:
    """Evals beside training (`[eval]` with its `[[eval.env]]`s): the policy's rewards on
    held-out tasks, at the versions the schedule names (docs/design.md § Evals). No
    `[[eval.env]]`, no evals. The keys follow prime-rl's `[orchestrator.eval]`."""

    # Every this many policy versions (0: only the base model, the last version and a
    # resumed run's first).
    interval: int = attrs.field(default=0, validator=at_least(0))
    # Prompts per env and eval, the same ones every time (-1: every row of its dataset).
    num_examples: int = attrs.field(default=-1, validator=at_least(-1))
    # Samples per prompt (pass@k is reported for k up to it where rewards are 0/1).
    rollouts_per_example: int = attrs.field(default=1, validator=at_least(1))
    # Evaluate version 0, the weights training starts from.
    eval_base_model: bool = True
    # A resumed run does not evaluate the version it resumes at.
    skip_eval_on_resume: bool = False
    # The share of the in-flight limit eval requests may take while training runs: a
    # batch is never delayed by more than this share of the fleet.
    inflight_share: float = attrs.field(default=0.25, validator=[greater_than(0), fraction])
    env: tuple[EnvConfig, ...] = ()

    @property
    def enabled(self) -> bool:
        return bool(self.env)


#: The local servers' vocabulary and eos id when neither `[sim]` nor a `[model]` tokenizer
#: gives them (a run of the toy environment).
SIM_VOCAB_SIZE = 32000
SIM_EOS_TOKEN_ID = 2


@attrs.frozen
class SimConfig:
    """The local simulation: inference servers, trainer, model shape and injected faults."""

    # N local inference servers started by `run`; 0 uses [inference] urls instead.
    inference_servers: int = attrs.field(default=0, validator=at_least(0))
    # The toy environment the run trains on when it lists no [[env]]: "math" is
    # single-turn, "chat" multi-turn, "mixed" draws from both (random token ids scored by
    # a hash: the simulator's own tests and benchmarks).
    env: ToyEnvName = "mixed"
    prompt_len_min: int = attrs.field(default=64, validator=at_least(1))
    prompt_len_max: int = attrs.field(
        default=512, validator=[at_least(1), not_below_sibling("prompt_len_min")]
    )
    max_tokens: int = attrs.field(default=256, validator=at_least(1))
    max_turns: int = attrs.field(default=3, validator=at_least(1))
    # Run the local trainer in-process (false when a trainer runs elsewhere).
    trainer: bool = False
    train_time_s: float = attrs.field(default=0.5, validator=at_least(0))
    # A model folder: the local trainer then writes each version as a full checkpoint of
    # it, its weights perturbed by the version, for servers that load weights from disk
    # ([inference] weight_update = "vllm"). Unset: a small marker file per version.
    trainer_checkpoint: Path | None = attrs.field(default=None, converter=_optional_absolute_path)
    layers: int = attrs.field(default=48, validator=at_least(1))
    top_k: int = attrs.field(default=8, validator=at_least(1))
    num_experts: int = attrs.field(default=128, validator=at_least(1))
    # The servers' vocabulary and the token a natural stop ends with (the model's EOS).
    # Unset: with real tasks, the `[model]` tokenizer's size and end-of-turn token (so that
    # the servers take every prompt token and completions stop the way the model's do),
    # else SIM_VOCAB_SIZE and SIM_EOS_TOKEN_ID (`tokens`).
    vocab_size: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(at_least(1))
    )
    eos_token_id: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(at_least(0))
    )
    # How the local servers answer: "prime-rl" (packed inline, or segments by handle) or
    # "upstream" (vLLM as released: .npy routing, mask lists, payload_dir ignored).
    reply_form: ReplyFormName = attrs.field(
        default=DEFAULT_REPLY_FORM, validator=one_of(REPLY_FORM_NAMES)
    )
    # Server settings, as in vLLM: false answers routed_experts / sampling_mask null.
    capture_routed_experts: bool = True
    capture_sampling_mask: bool = True
    # By handle, each segment carries its bytes' digest (this project's extension).
    payload_digests: bool = False
    # What the servers' GET /version answers, as vLLM names its release. The default is
    # no release of vLLM (the simulator reloads every weight); "0.30.0" makes them pass
    # for a vLLM that drops a MoE model's expert weights on reload (design.md §13).
    vllm_version: str = SIM_VLLM_VERSION
    time_per_token_s: float = attrs.field(default=0.0, validator=at_least(0))
    # Sequences each server generates at once (a request's n choices count n), the rest
    # queue (vLLM's max_num_seqs); 0: any.
    max_num_seqs: int = attrs.field(default=0, validator=at_least(0))
    http_500_rate: float = attrs.field(default=0.0, validator=fraction)
    hang_rate: float = attrs.field(default=0.0, validator=fraction)
    malformed_rate: float = attrs.field(default=0.0, validator=fraction)
    bad_segment_rate: float = attrs.field(default=0.0, validator=fraction)
    payload_error_rate: float = attrs.field(default=0.0, validator=fraction)
    fault_seed: int = 0

    def __attrs_post_init__(self) -> None:
        # Here rather than a validator on top_k, so that num_experts' own check runs first.
        not_above_sibling("num_experts")(self, attrs.fields(SimConfig).top_k, self.top_k)
        vocab_size = SIM_VOCAB_SIZE if self.vocab_size is None else self.vocab_size
        if self.eos_token_id is not None and self.eos_token_id >= vocab_size:
            raise InvalidValue(
                f"must be below {{0}} ({vocab_size}): a token id of the vocabulary",
                value=self.eos_token_id,
                key="eos_token_id",
                siblings=["vocab_size"],
            )

    def tokens(self, model: tuple[int, int] | None = None) -> tuple[int, int]:
        """The servers' (vocabulary size, eos token id): each as `[sim]` sets it, else the
        `[model]` tokenizer's (`model`: its size and end-of-turn id, with real tasks), else
        the simulator's defaults."""
        follows = model or (SIM_VOCAB_SIZE, SIM_EOS_TOKEN_ID)
        vocab_size = follows[0] if self.vocab_size is None else self.vocab_size
        eos = follows[1] if self.eos_token_id is None else self.eos_token_id
        return vocab_size, eos


@attrs.frozen
class MetricsConfig:
    """The metrics endpoint."""

    # "" is off; "host:port" serves metrics there.
    listen: str = attrs.field(default="", validator=listen_address)


WandbMode = Literal["offline", "online"]


@attrs.frozen
class WandbConfig:
    """Weights & Biases, optionally (the `wandb` extra): each shipped batch's and each
    eval's figures, as `steps.jsonl` and `evals.jsonl` hold them."""

    enabled: bool = False
    project: str = "rollout-orchestrator"
    # "" : your default entity.
    entity: str = ""
    # The W&B run's name ("": the run directory's name). A resumed run continues it.
    name: str = ""
    # "offline": written under <run_dir>/wandb, uploaded later with `wandb sync`;
    # "online": sent as the run goes (WANDB_API_KEY in the daemon's environment).
    mode: WandbMode = "offline"


@attrs.frozen
class ProgressConfig:
    """Telling the operator how a batch fills, and when nothing ships."""

    # No batch shipped for this long (since the start or the last batch): warn, again
    # every as long while it lasts, with what is holding the batch up. 0 turns it off.
    stall_warning_s: float = attrs.field(default=60.0, validator=at_least(0))
    # Every this many seconds while the daemon runs, log a `progress` line at info level:
    # the batch being filled, its samples ready and needed, rollouts in flight and per
    # second, discards and failures since the previous line. 0 turns it off.
    report_interval_s: float = attrs.field(default=30.0, validator=at_least(0))
    # Rollouts keep finishing and none is trainable for this long (and at least four
    # batches' worth of them): the run stops with exit status 2 and one line naming why
    # (orchestrator/daemon/reporting/no_progress.py). 0 never stops.
    no_progress_stop_s: float = attrs.field(default=600.0, validator=at_least(0))


@attrs.frozen
class ShutdownConfig:
    """How long in-flight work may finish after SIGTERM/SIGINT."""

    grace_s: float = attrs.field(default=10.0, validator=greater_than(0))


@attrs.frozen
class Config:
    """A whole run's configuration. Build it with `load_config`; it is immutable.

    Constructing it directly runs the same checks and raises ConfigError (an InvalidValue
    naming the key) on a bad value. Relative paths are made absolute against the current
    directory when the object is built.
    """

    run_dir: Path = attrs.field(converter=_absolute_path)
    # 0 runs until stopped.
    max_steps: int = attrs.field(default=0, validator=at_least(0))
    seed: int = 0
    staleness: StalenessConfig = attrs.field(factory=StalenessConfig)
    batch: BatchConfig = attrs.field(factory=BatchConfig)
    payload: PayloadConfig = attrs.field(factory=PayloadConfig)
    inference: InferenceConfig = attrs.field(factory=InferenceConfig)
    trainer: TrainerConfig = attrs.field(factory=TrainerConfig)
    model: ModelConfig = attrs.field(factory=ModelConfig)
    train: TrainConfig = attrs.field(factory=TrainConfig)
    env: tuple[EnvConfig, ...] = ()
    rewards: RewardsConfig = attrs.field(factory=RewardsConfig)
    eval: EvalConfig = attrs.field(factory=EvalConfig)
    sim: SimConfig = attrs.field(factory=SimConfig)
    metrics: MetricsConfig = attrs.field(factory=MetricsConfig)
    wandb: WandbConfig = attrs.field(factory=WandbConfig)
    progress: ProgressConfig = attrs.field(factory=ProgressConfig)
    shutdown: ShutdownConfig = attrs.field(factory=ShutdownConfig)

    def __attrs_post_init__(self) -> None:
        _check_inference_source(self)
        _check_directories(self)
        _check_routing_shape(self)
        _check_reply_limits(self)
        _check_trainer_format(self)
        _check_envs(self)

    @property
    def payload_root(self) -> Path:
        """Where payload files go: `payload.root`, or `<run_dir>/payloads` (absolute)."""
        return self.payload.root or self.run_dir / "payloads"

    @property
    def batches_dir(self) -> Path:
        """Where batches are published: `trainer.batches_dir`, or `<run_dir>/batches`."""
        return self.trainer.batches_dir or self.run_dir / "batches"

    @property
    def weights_dir(self) -> Path:
        """Where the trainer publishes policies: `trainer.weights_dir`, or `<run_dir>/weights`."""
        return self.trainer.weights_dir or self.run_dir / "weights"

    @property
    def train_seq_len(self) -> int:
        """The tokens of one prime-rl micro batch: `trainer.seq_len`, or
        `batch.max_seq_len` when it is 0."""
        return self.trainer.seq_len or self.batch.max_seq_len

    @property
    def handoff(self) -> HandoffFormat:
        """The hand-off format `trainer.format` names (validated at load): the one place
        the config's name is looked up; everything past the config passes the object."""
        return handoff_format(self.trainer.format)

    @property
    def handoff_settings(self) -> HandoffSettings:
        """What the trainer format (`trainer.format`) is told of the run: the one place
        the hand-off's settings are built from the config."""
        return HandoffSettings(
            batches_dir=self.batches_dir,
            weights_layout=self.trainer.weights_layout,
            data_world_size=self.trainer.data_world_size,
            seq_len=self.train_seq_len,
            env_name=self.env[0].name if len(self.env) == 1 else self.sim.env,
        )

    @property
    def max_completion_tokens(self) -> int:
        """The longest completion any request asks for: the largest `max_tokens` of the
        `[[env]]`s (or the toy environment's, `sim.max_tokens`) and `[[eval.env]]`s."""
        evals = [env.max_tokens for env in self.eval.env]
        if self.env:
            return max([*evals, *(env.max_tokens for env in self.env)])
        return max([self.sim.max_tokens, *evals])

    @property
    def group_choices(self) -> int:
        """The choices a group's first request asks for (`sampling_params.n`): the group's
        size with `inference.group_request`, else 1 (one request per rollout), and 1 behind
        a disaggregated router, whose prefill reply carries one `kv_transfer_params` for
        the whole request (vLLM's `RequestOutput`), not one per choice."""
        inference = self.inference
        if inference.group_request and not inference.disaggregated:
            return self.batch.group_size
        return 1

    @property
    def max_context_tokens(self) -> int:
        """The longest conversation a request may carry: `batch.max_seq_len`, or longer
        for the toy environment's turns."""
        if self.env:
            return max(
                self.batch.max_seq_len, max(env.max_turns * env.max_tokens for env in self.env)
            )
        sim = self.sim
        return max(self.batch.max_seq_len, sim.prompt_len_max + sim.max_turns * sim.max_tokens)

    @property
    def evals_file(self) -> Path:
        """Where each eval's results are appended, one JSON line each: `<run_dir>/evals.jsonl`."""
        return self.run_dir / "evals.jsonl"

    @property
    def steps_file(self) -> Path:
        """Where each shipped batch's figures are appended, one JSON line each:
        `<run_dir>/steps.jsonl` (what `orchestrator report` draws)."""
        return self.run_dir / "steps.jsonl"

    @property
    def trainer_steps_file(self) -> Path:
        """Where the reference trainer appends one JSON line per step (its loss and the
        training-inference mismatch): `<run_dir>/trainer.jsonl`, drawn by the report."""
        return self.run_dir / "trainer.jsonl"

    @property
    def state_dir(self) -> Path:
        """The daemon's own state (progress, lock): `<run_dir>/orchestrator`."""
        return self.run_dir / "orchestrator"

    @property
    def inference_hosts(self) -> frozenset[str]:
        """The distinct inference hosts: 127.0.0.1 for a local fleet, else the URLs' hosts.

        Hosts are compared by name, so `localhost` and `127.0.0.1` count as two.
        """
        if self.sim.inference_servers > 0:
            return frozenset({LOCAL_HOST})
        return frozenset(_url_host(url) for url in self.inference.urls)

    @property
    def by_handle(self) -> bool:
        """Whether payloads travel by handle (files under the payload root), not inline.

        `payload.mode` "by_handle"/"inline" is taken as given. "auto" is by handle when
        payload fields are requested and either there is more than one inference host or
        `inference.multi_node` is set; inline otherwise. Disaggregated prefill/decode
        takes either mode (docs/design.md §4).
        """
        return _choose_payload_mode(self)[0]

    @property
    def payload_mode_reason(self) -> str:
        """Why `by_handle` came out the way it did, in a few words (for check-config)."""
        return _choose_payload_mode(self)[1]

    @property
    def routing_shape(self) -> RoutingShape | None:
        """The routing shape replies are checked against from the start of the run:
        `payload.layers`/`top_k`/`num_experts` when set, else the local fleet's model
        (`[sim]`, when it serves), else `None` (fixed by the run's first routing reply)."""
        payload = self.payload
        if payload.layers and payload.top_k:
            return RoutingShape(payload.layers, payload.top_k, payload.num_experts or None)
        if self.sim.inference_servers > 0:
            return RoutingShape(self.sim.layers, self.sim.top_k, self.sim.num_experts)
        return None

    @property
    def max_reply_bytes(self) -> int:
        """The most bytes of one generate reply the daemon reads: `inference.max_reply_bytes`,
        or derived from the payload mode, the longest completion and conversation
        (`max_completion_tokens`, `max_context_tokens`), the model's routing shape when
        the config knows it (`routing_shape`) and the choices of a group's request
        (`group_choices`; see `orchestrator.config.reply_limits`)."""
        if self.inference.max_reply_bytes:
            return self.inference.max_reply_bytes
        shape = self.routing_shape
        model = None if shape is None else ModelShape(shape.layers, shape.top_k)
        return derived_max_reply_bytes(
            by_handle=self.by_handle,
            fields=self.payload.fields,
            max_tokens=self.max_completion_tokens,
            max_context_tokens=self.max_context_tokens,
            model=model,
            choices=self.group_choices,
        )

    @property
    def max_buffered_reply_bytes(self) -> int:
        """The most bytes all in-flight generate replies hold together:
        `inference.max_buffered_reply_bytes`, or derived from `max_reply_bytes`."""
        if self.inference.max_buffered_reply_bytes:
            return self.inference.max_buffered_reply_bytes
        return derived_max_buffered_reply_bytes(
            max_reply_bytes=self.max_reply_bytes,
            max_inflight=self.inference.max_inflight,
            choices=self.group_choices,
        )


def _url_host(url: str) -> str:
    return (urlsplit(url).hostname or "").lower()


def _choose_payload_mode(config: Config) -> tuple[bool, str]:
    mode = config.payload.mode
    if mode != "auto":
        return mode == "by_handle", f'set explicitly: payload.mode = "{mode}"'
    if not config.payload.fields:
        return False, "auto: no payload fields requested"
    hosts = config.inference_hosts
    if len(hosts) > 1:
        return True, f"auto: {len(hosts)} inference hosts share the payload root"
    if config.inference.multi_node:
        return True, "auto: inference.multi_node = true"
    return False, "auto: one inference host and not multi_node"


def _check_inference_source(config: Config) -> None:
    servers = config.sim.inference_servers
    urls = config.inference.urls
    if servers == 0 and not urls:
        raise InvalidValue(
            "must list at least one server when sim.inference_servers = 0 "
            "(or set sim.inference_servers >= 1 to start local servers)",
            value=urls,
            key="inference.urls",
        )
    if servers > 0 and urls:
        raise InvalidValue(
            f"must be empty when sim.inference_servers = {servers}: "
            "the local servers would replace them",
            value=urls,
            key="inference.urls",
        )


def _check_reply_limits(config: Config) -> None:
    buffered = config.inference.max_buffered_reply_bytes
    if buffered and buffered < config.max_reply_bytes:
        raise InvalidValue(
            f"must be at least the per-reply cap ({config.max_reply_bytes} bytes): "
            "a reply at the cap could never be read",
            value=buffered,
            key="inference.max_buffered_reply_bytes",
        )


def _check_trainer_format(config: Config) -> None:
    trainer = config.trainer
    problem = config.handoff.check(config.handoff_settings)
    if problem is not None:
        raise InvalidValue(problem, value=trainer.format, key="trainer.format")
    # Whatever the format: a step holds no sample longer than batch.max_seq_len.
    if trainer.seq_len and trainer.seq_len < config.batch.max_seq_len:
        raise InvalidValue(
            f"must be 0 or >= batch.max_seq_len ({config.batch.max_seq_len}): "
            "a micro batch must hold the longest sample the daemon ships",
            value=trainer.seq_len,
            key="trainer.seq_len",
        )


def _check_envs(config: Config) -> None:
    for section, envs in (("env", config.env), ("eval.env", config.eval.env)):
        names = [env.name for env in envs]
        for index, name in enumerate(names):
            if name in names[:index]:
                raise InvalidValue(
                    f"names another [[{section}]] already: each env needs its own name",
                    value=name,
                    key=f"{section}[{index}].name",
                )
        if envs and config.model.tokenizer is None:
            raise InvalidValue(
                f"must name the model's local tokenizer folder: [[{section}]] prompts are "
                f"rendered with its chat template (env {names[0]!r})",
                key="model.tokenizer",
            )
        for index, env in enumerate(envs):
            renders = env.dataset is not None or env.verifiers is not None
            if renders and env.max_tokens >= config.batch.max_seq_len:
                raise InvalidValue(
                    f"must be below batch.max_seq_len ({config.batch.max_seq_len}): the "
                    "prompt needs room too",
                    value=env.max_tokens,
                    key=f"{section}[{index}].max_tokens",
                )
    for index, env in enumerate(config.eval.env):
        if env.factory is not None and config.eval.num_examples < 1:
            raise InvalidValue(
                "must be set (at least 1) for a plugin env: its prompts have no count "
                f"(eval.env[{index}] {env.name!r})",
                value=config.eval.num_examples,
                key="eval.num_examples",
            )


def _check_routing_shape(config: Config) -> None:
    payload = config.payload
    if bool(payload.layers) != bool(payload.top_k):
        key, value = (
            ("payload.top_k", payload.top_k)
            if payload.layers
            else ("payload.layers", payload.layers)
        )
        raise InvalidValue(
            "must be set together with payload.layers and payload.top_k (0 leaves both open)",
            value=value,
            key=key,
        )
    if payload.num_experts and payload.top_k > payload.num_experts:
        raise InvalidValue(
            f"must not exceed payload.num_experts ({payload.num_experts})",
            value=payload.top_k,
            key="payload.top_k",
        )


def _check_directories(config: Config) -> None:
    if config.run_dir == Path(config.run_dir.anchor):
        raise InvalidValue("must not be the filesystem root", value=config.run_dir, key="run_dir")
    root = config.payload_root
    problem = dangerous_root_problem(root)
    if problem:
        raise InvalidValue(problem, value=root, key="payload.root")
    trainer_dirs = {
        "trainer.batches_dir": config.batches_dir,
        "trainer.weights_dir": config.weights_dir,
    }
    for key, directory in trainer_dirs.items():
        if _is_within(root, directory):
            raise InvalidValue(
                f"must not be inside {key} ({directory}): "
                "the trainer's files and payload files would be mixed up",
                value=root,
                key="payload.root",
            )
    # A fresh run wipes the payload root, so nothing else of the run may live below it.
    owned = {**trainer_dirs, "the daemon's state directory": config.state_dir}
    for key, directory in owned.items():
        if _is_within(directory, root):
            raise InvalidValue(
                f"must not contain {key} ({directory}): a fresh run wipes the payload root",
                value=root,
                key="payload.root",
            )
    if config.batches_dir == config.weights_dir:
        raise InvalidValue(
            "must differ from trainer.weights_dir: both hold step_N directories",
            value=config.batches_dir,
            key="trainer.batches_dir",
        )

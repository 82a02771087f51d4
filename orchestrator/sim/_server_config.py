"""What one simulated inference server is: `SimInferenceConfig`, the settings every local
server (`orchestrator.sim.inference`) and the fleet built from a run's config
(`orchestrator.sim.fleet`) share."""

from __future__ import annotations

import attrs

from orchestrator.config import SIM_VLLM_VERSION
from orchestrator.reply_form_names import DEFAULT_REPLY_FORM, ReplyFormName

from ._faults import FaultRates
from ._model import SimModel
from ._pd import SIM_ROLES, SimRole
from .reply_forms import REPLY_FORMS

__all__ = ["DEFAULT_SERVED_MODEL_NAME", "SimInferenceConfig"]

#: The model name a server answers to unless told otherwise.
DEFAULT_SERVED_MODEL_NAME = "sim-moe"


def _non_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must not be negative, got {value}")


def _reply_form(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in REPLY_FORMS:
        raise ValueError(f"{attribute.name} must be one of {', '.join(REPLY_FORMS)}, got {value!r}")


def _role(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in SIM_ROLES:
        raise ValueError(f"{attribute.name} must be one of {', '.join(SIM_ROLES)}, got {value!r}")


def _model_name(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not value:
        raise ValueError(f"{attribute.name} must not be empty")


@attrs.frozen
class SimInferenceConfig:
    """Everything one simulated server needs; the defaults are a quiet, fast server.

    - `model`: the simulated model's shape (48 layers, top-8 of 128 experts by default).
    - `served_model_name`: the name a request's `model` must match (else 404, as vLLM).
    - `host`, `port`: where to listen; port 0 picks a free port (reported on start).
    - `reply_form`: the name of the form replies take (orchestrator.sim.reply_forms):
      "prime-rl" (packed inline, or by handle) or "upstream" (vLLM's own form, always
      inline).
    - `capture_routed_experts`, `capture_sampling_mask`: whether replies carry routing and
      masks (vLLM's `enable_return_routed_experts` and its like: server settings).
    - `payload_digests`: by handle, add each segment's `digest` (this project's extension).
    - `time_per_token_s`, `request_overhead_s`: the latency model, slept per request:
      overhead + time per token x the longest choice (choices decode in parallel).
    - `max_num_seqs`: sequences generated at once (vLLM's engine setting of that name; a
      request's `n` choices are `n` sequences, and a request for more is refused with
      vLLM's 400); the rest wait their turn, so past it turnaround grows with the
      requests sent. 0: no bound.
    - `weight_update_s`: how long `/update_weights` takes.
    - `faults`, `fault_seed`: fault rates and the seed of the generator they are drawn from.
    - `fsync`: fsync each payload file before closing it.
    - `max_model_len`: longest prompt + max_tokens accepted; an absent `max_tokens` is
      what the prompt leaves of it.
    - `worker_threads`: bound on concurrent model computations and on concurrent writes.
    - `role`: "aggregated" (a whole server), or one side of disaggregated prefill/decode,
      "prefill" or "decode" (see orchestrator.sim.inference).
    - `disaggregated`: serve a P/D deployment on `host:port` (a router in front of a
      prefill and a decode server, each with this config's other settings; their faults
      drawn from seeds `2 * fault_seed` and `2 * fault_seed + 1`).
    - `api_key`: the bearer token requests to vLLM's guarded paths (the generate endpoint)
      must carry, as `vllm serve --api-key` asks for it (401 without); "": none. In a P/D
      deployment the router asks for it.
    - `ignores_n`: answer one choice whatever a request's `n` asks for, as a server built
      on prime-rl's writer functions, or an OpenAI-compatible proxy that drops `n`, does.
    - `vllm_version`: what `GET /version` answers, as vLLM names its release. The default
      is no release (the simulator reloads every weight); a test sets a release of
      `orchestrator.wire.MOE_RELOAD_BROKEN` to be treated as that vLLM; None: no such
      endpoint (404).

    Raises `ValueError` from the constructor when a field is out of range.
    """

    model: SimModel = attrs.field(factory=SimModel)
    served_model_name: str = attrs.field(default=DEFAULT_SERVED_MODEL_NAME, validator=_model_name)
    host: str = "127.0.0.1"
    port: int = attrs.field(
        default=0, validator=[attrs.validators.ge(0), attrs.validators.le(65535)]
    )
    reply_form: ReplyFormName = attrs.field(default=DEFAULT_REPLY_FORM, validator=_reply_form)
    capture_routed_experts: bool = True
    capture_sampling_mask: bool = True
    payload_digests: bool = False
    time_per_token_s: float = attrs.field(default=0.0, validator=_non_negative)
    request_overhead_s: float = attrs.field(default=0.0, validator=_non_negative)
    weight_update_s: float = attrs.field(default=0.0, validator=_non_negative)
    faults: FaultRates = attrs.field(factory=FaultRates)
    fault_seed: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    fsync: bool = False
    max_model_len: int = attrs.field(default=65536, validator=attrs.validators.ge(2))
    worker_threads: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    role: SimRole = attrs.field(default="aggregated", validator=_role)
    disaggregated: bool = False
    max_num_seqs: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    api_key: str = attrs.field(default="", repr=False)
    vllm_version: str | None = SIM_VLLM_VERSION
    ignores_n: bool = False

    def __attrs_post_init__(self) -> None:
        if self.disaggregated and self.role != "aggregated":
            raise ValueError(
                f"role {self.role!r} is one side of a P/D deployment; disaggregated serves both"
            )

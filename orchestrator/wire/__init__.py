"""The inference HTTP API in one place: its paths, the generate request, the array and
segment forms of a reply, and the parsed reply. The daemon's client and the local fleet
both build on it (docs/protocol.md)."""

from orchestrator.wire.errors import error_body
from orchestrator.wire.generate import (
    REQUEST_KEYS,
    SAMPLING_KEYS,
    InferenceFailure,
    TooFewChoices,
    build_generate_request,
    encoded_token_ids,
    parse_choice,
    parse_generate_response,
    reply_choices,
)
from orchestrator.wire.weight_updates import (
    MOE_RELOAD_BROKEN,
    UPDATE_WEIGHTS_PATH,
    VERSION_PATH,
    VLLM_DEV_PATHS,
    WEIGHT_UPDATES,
    ControlCall,
    WeightUpdate,
    WeightUpdatePlan,
    moe_reload_refusal,
    refusal_hint,
    weight_update_plan,
)

#: Generate tokens for one turn (vLLM's tokens-in/tokens-out endpoint).
GENERATE_PATH = "/inference/v1/generate"
#: Liveness, and which policy the server holds.
HEALTH_PATH = "/health"
#: The models a server serves (OpenAI's list, as vLLM answers it: `data[].id`).
MODELS_PATH = "/v1/models"

__all__ = [
    "GENERATE_PATH",
    "HEALTH_PATH",
    "MODELS_PATH",
    "MOE_RELOAD_BROKEN",
    "REQUEST_KEYS",
    "SAMPLING_KEYS",
    "UPDATE_WEIGHTS_PATH",
    "VERSION_PATH",
    "VLLM_DEV_PATHS",
    "WEIGHT_UPDATES",
    "ControlCall",
    "InferenceFailure",
    "TooFewChoices",
    "WeightUpdate",
    "WeightUpdatePlan",
    "build_generate_request",
    "encoded_token_ids",
    "error_body",
    "moe_reload_refusal",
    "parse_choice",
    "parse_generate_response",
    "refusal_hint",
    "reply_choices",
    "weight_update_plan",
]

"""The inference HTTP API in one place: its paths, the generate request, the array and
segment forms of a reply, and the parsed reply. The daemon's client and the local fleet
both build on it (docs/protocol.md)."""

from orchestrator.wire.generate import (
    REQUEST_KEYS,
    SAMPLING_KEYS,
    InferenceFailure,
    build_generate_request,
    parse_generate_response,
)

#: Generate tokens for one turn (vLLM's tokens-in/tokens-out endpoint).
GENERATE_PATH = "/inference/v1/generate"
#: Load a published policy: `{"weight_dir": ...}`.
UPDATE_WEIGHTS_PATH = "/update_weights"
#: Liveness, and which policy the server holds.
HEALTH_PATH = "/health"

__all__ = [
    "GENERATE_PATH",
    "HEALTH_PATH",
    "REQUEST_KEYS",
    "SAMPLING_KEYS",
    "UPDATE_WEIGHTS_PATH",
    "InferenceFailure",
    "build_generate_request",
    "parse_generate_response",
]

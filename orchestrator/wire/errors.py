"""vLLM's error body, `ErrorResponse`: what every HTTP server of the project answers a
request it refuses with (the local fleet's, and the daemon's model endpoint for
environments that drive their own turns), as vLLM's OpenAI-compatible server does."""

from __future__ import annotations

from typing import Any


def error_type(status: int) -> str:
    """vLLM's error type for an HTTP status."""
    if status == 404:
        return "NotFoundError"
    if status >= 500:
        return "InternalServerError"
    return "BadRequestError"


def error_body(status: int, message: str) -> dict[str, Any]:
    """vLLM's `ErrorResponse`: `{"error": {"message", "type", "param", "code"}}`."""
    return {
        "error": {
            "message": " ".join(message.split()),
            "type": error_type(status),
            "param": None,
            "code": status,
        }
    }

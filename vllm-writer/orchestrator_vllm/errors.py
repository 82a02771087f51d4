"""vLLM's error body, for the answers the writer gives itself."""

from __future__ import annotations

from typing import Any


def error_body(status: int, message: str) -> dict[str, Any]:
    """vLLM's `ErrorResponse`."""
    kinds = {400: "BadRequestError", 404: "NotFoundError"}
    return {
        "error": {
            "message": message,
            "type": kinds.get(status, "InternalServerError"),
            "param": None,
            "code": status,
        }
    }

"""The bearer token of servers closed with `vllm serve --api-key`: where it comes from, and
how it is kept out of sight.

vLLM's API server (and prime-rl's, built on it) checks `Authorization: Bearer <token>` on
every path under `/v1`, `/v2`, `/inference` and `/cohere`, and answers anything else there
with 401 `{"error": "Unauthorized"}`; `/health` and the dev-mode control endpoints are not
guarded. The daemon sends the token with every request to every server, generate and
control alike.

`[inference] api_key_env` names an environment variable holding the token, or
`api_key_file` a file holding it (one line; surrounding whitespace, such as the newline an
editor adds, is not part of it). `load_bearer_token` reads it once, before anything of
the run changes, and raises `UserError` (one line, naming where it looked and never what
it found) when it is missing, empty or not a token. The token lives in a `BearerToken`,
whose repr hides it; nothing prints it, logs it or writes it to `progress.json`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import attrs

from orchestrator.config import InferenceConfig
from orchestrator.config.errors import format_toml_value
from orchestrator.errors import UserError

#: A token file larger than this is not a token file.
MAX_TOKEN_FILE_BYTES = 64 * 1024


@attrs.frozen(repr=False)
class BearerToken:
    """A token and where it came from (`source`, for messages). `str()` and `repr()` name
    the source only."""

    value: str
    source: str

    @property
    def authorization(self) -> str:
        """The `Authorization` header's value."""
        return f"Bearer {self.value}"

    def __repr__(self) -> str:
        return f"BearerToken(from {self.source})"

    __str__ = __repr__


def load_bearer_token(inference: InferenceConfig) -> BearerToken | None:
    """The token `inference` points at, or None when it points at none. Blocking (it may
    read a file). Raises `UserError`."""
    if inference.api_key_env:
        name = inference.api_key_env
        source = f"inference.api_key_env = {format_toml_value(name)}"
        text = os.environ.get(name)
        if text is None:
            raise UserError(f"{source}: the daemon's environment has no variable {name}")
        return _token(text, source)
    if inference.api_key_file is not None:
        source = f"inference.api_key_file = {format_toml_value(inference.api_key_file)}"
        return _token(_read_token_file(inference.api_key_file, source), source)
    return None


def _read_token_file(path: Path, source: str) -> str:
    # Links are followed (Kubernetes mounts secrets as links); a FIFO must not hang the
    # start, hence the non-blocking open, and the type is checked on what was opened.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as file:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise UserError(f"{source}: not a regular file")
            data = file.read(MAX_TOKEN_FILE_BYTES + 1)
    except OSError as exc:
        raise UserError(f"{source}: cannot read it: {exc.strerror or exc}") from None
    if len(data) > MAX_TOKEN_FILE_BYTES:
        raise UserError(f"{source}: longer than {MAX_TOKEN_FILE_BYTES} bytes, not a token")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise UserError(f"{source}: not ASCII text, not a token") from None


def _token(text: str, source: str) -> BearerToken:
    value = text.strip()
    if not value:
        raise UserError(f"{source}: the token is empty")
    # A header value: visible ASCII, no spaces (a space or a newline inside would split
    # the header or the token vLLM compares).
    if not all("!" <= char <= "~" for char in value):
        raise UserError(f"{source}: the token has spaces or characters a header cannot carry")
    return BearerToken(value, source)


def unauthorized_detail(url: str, *, sent_token: bool) -> str:
    """What a 401 from `url` means, cause first: the failure's detail (kind
    "unauthorized")."""
    if sent_token:
        return f"the server refused the bearer token (its --api-key differs): {url}: HTTP 401"
    return (
        "the server wants a bearer token: set [inference] api_key_env or api_key_file: "
        f"{url}: HTTP 401"
    )

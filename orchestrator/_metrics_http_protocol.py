"""Just enough HTTP/1.1 for a scrape endpoint, sans I/O: parse a request head, decide the
answer, write a response.

The server only ever answers `GET`/`HEAD` without a body, so it reads request heads and
nothing else. A request that carries a body is answered and the connection then closed,
because skipping the body correctly is more code than a scraper will ever need.
"""

from __future__ import annotations

import re
from http import HTTPStatus
from urllib.parse import urlsplit

import attrs

METRICS_PATH = "/metrics"
# Prometheus sends a request head of a few hundred bytes; anything near this is not a scrape.
MAX_HEAD_BYTES = 8192
# The blank line that ends a request head. RFC 9112 §2.2 lets a server accept a bare LF as
# a line end, which keeps `printf 'GET /metrics HTTP/1.0\n\n' | nc` working.
HEAD_END = re.compile(rb"\r?\n\r?\n")

# RFC 9110 `token`: what a method and a header name may contain.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(r"HTTP/1\.[01]")


class MalformedRequest(ValueError):
    """A request head that is not valid HTTP/1.x; the message says what is wrong."""


@attrs.frozen
class RequestHead:
    """A parsed request line and its headers (names lower-cased, in order)."""

    method: str
    target: str
    path: str  # the target's path, without query or fragment (absolute-form accepted)
    version: str
    headers: tuple[tuple[str, str], ...]

    def header(self, name: str) -> str | None:
        """The first value of header `name` (case-insensitive), or `None`."""
        name = name.lower()
        return next((value for key, value in self.headers if key == name), None)

    @property
    def has_body(self) -> bool:
        length = self.header("content-length")
        return self.header("transfer-encoding") is not None or (
            length is not None and length.strip() != "0"
        )

    @property
    def keep_alive(self) -> bool:
        """Whether the connection may serve another request after this one: HTTP/1.1
        unless `Connection: close`; HTTP/1.0 never (keep-alive there is opt-in, and no
        scraper needs it); never after a body we did not read."""
        if self.version != "HTTP/1.1" or self.has_body:
            return False
        connection = self.header("connection") or ""
        return "close" not in {option.strip().lower() for option in connection.split(",")}


def parse_request_head(head: bytes) -> RequestHead:
    """Parse a request head: the bytes before the blank line that ends it (`HEAD_END`).

    Raises `MalformedRequest` for anything a strict HTTP/1.x server rejects: a request line
    that is not `METHOD SP target SP HTTP/1.x`, a header line without a valid name and a
    colon, folded header lines, bytes that are not ASCII in the request line, or an
    HTTP/1.1 request without a `Host` header.
    """
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        # Header values may be Latin-1 (obsolete but legal); the request line may not.
        text = head.decode("latin-1")
        if not text.split("\n", 1)[0].isascii():
            raise MalformedRequest("the request line is not ASCII") from None
    request_line, *header_lines = (line.removesuffix("\r") for line in text.split("\n"))
    parts = request_line.split(" ")
    if len(parts) != 3:
        raise MalformedRequest(f"bad request line {request_line[:80]!r}")
    method, target, version = parts
    if not _TOKEN.fullmatch(method):
        raise MalformedRequest(f"bad method {method[:40]!r}")
    if not _VERSION.fullmatch(version):
        raise MalformedRequest(f"unsupported protocol {version[:40]!r}")
    if not (target.startswith("/") or target.startswith(("http://", "https://"))):
        raise MalformedRequest(f"bad request target {target[:80]!r}")
    if any(ord(char) <= 32 or ord(char) == 127 for char in target):
        raise MalformedRequest("control character in the request target")
    try:
        path = urlsplit(target).path
    except ValueError as exc:  # e.g. an unclosed "[" in an absolute-form host
        raise MalformedRequest(f"bad request target {target[:80]!r}: {exc}") from None
    headers: list[tuple[str, str]] = []
    for line in header_lines:
        name, colon, value = line.partition(":")
        if not colon or not _TOKEN.fullmatch(name):
            # Also catches obsolete line folding: a continuation starts with whitespace.
            raise MalformedRequest(f"bad header line {line[:80]!r}")
        if "\r" in value or "\n" in value or "\0" in value:
            raise MalformedRequest(f"control character in header {name!r}")
        headers.append((name.lower(), value.strip(" \t")))
    request = RequestHead(method, target, path, version, tuple(headers))
    if version == "HTTP/1.1" and request.header("host") is None:
        raise MalformedRequest("an HTTP/1.1 request needs a Host header")
    return request


@attrs.frozen
class Response:
    """What to send back: status, headers besides the framing ones, and the body."""

    status: HTTPStatus
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


def plain_response(status: HTTPStatus, message: str = "") -> Response:
    """A short text/plain response: the message, or the status phrase."""
    body = (message or status.phrase) + "\n"
    return Response(status, "text/plain; charset=utf-8", body.encode())


def route(request: RequestHead) -> HTTPStatus | None:
    """`None` when the request asks for the metrics, otherwise the error status to send:
    404 for another path, 405 for another method on the metrics path."""
    if request.path != METRICS_PATH:
        return HTTPStatus.NOT_FOUND
    if request.method not in ("GET", "HEAD"):
        return HTTPStatus.METHOD_NOT_ALLOWED
    return None


def encode_response(response: Response, *, head_only: bool, keep_alive: bool) -> bytes:
    """The bytes of `response` as HTTP/1.1; `head_only` (a HEAD request) sends the headers
    of the full response without its body."""
    lines = [
        f"HTTP/1.1 {response.status.value} {response.status.phrase}",
        f"Content-Type: {response.content_type}",
        f"Content-Length: {len(response.body)}",
        f"Connection: {'keep-alive' if keep_alive else 'close'}",
        *(f"{name}: {value}" for name, value in response.headers),
    ]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head if head_only else head + response.body

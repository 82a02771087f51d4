"""The digest a segment may carry: blake2b with a 16-byte (128-bit) digest, as hex."""

from __future__ import annotations

import hashlib

DIGEST_SIZE = 16
DIGEST_HEX_LEN = 2 * DIGEST_SIZE


def payload_digest(data: bytes | bytearray | memoryview) -> str:
    """Return the blake2b-128 hex digest of `data`."""
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).hexdigest()


def is_digest_hex(text: str) -> bool:
    """Whether `text` has the form of a digest: 32 lowercase hex digits."""
    return len(text) == DIGEST_HEX_LEN and all(c in "0123456789abcdef" for c in text)

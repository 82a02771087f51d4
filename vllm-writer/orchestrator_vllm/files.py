"""Where a payload file may be written, and writing it.

The payload root is shared: other hosts write into it, and anyone with write access to
that filesystem can plant links in it. So the writer follows the rules the daemon's reader
follows (the daemon's docs/operations.md § Security model):

- `payload_dir` must be an absolute path spelled plainly (no `.`, `..`, doubled or
  trailing slashes), the server's `--payload-root` or below it (`lexical_problem`,
  checked before the request reaches vLLM, without touching the filesystem);
- the directories below the root are opened one by one relative to their parent with
  `O_NOFOLLOW | O_DIRECTORY`: a symbolic link anywhere below the root is refused, never
  followed. Only the last one may be missing; it is then created (the daemon's
  `<root>/v<k>` of a new policy version);
- the file is created relative to that directory's descriptor, `O_CREAT | O_EXCL |
  O_NOFOLLOW`, under a fresh `<uuid4 hex>.bin` name, written whole, fsynced when asked
  (and the directory too when this call created it), and closed before the reply is sent
  (NFS close-to-open). A partly written file is removed.

Blocking: the middleware calls these in worker threads.
"""

from __future__ import annotations

import errno
import os
import posixpath
import uuid
from collections.abc import Sequence

from orchestrator_vllm.payloads import FieldArray

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_BELOW_ROOT = _DIRECTORY | os.O_NOFOLLOW


class PayloadDirRefused(Exception):
    """A `payload_dir` the server does not write into (one line: the 400's message)."""


def lexical_problem(payload_dir: object, root: str | None) -> str | None:
    """Why `payload_dir` is refused before anything is read, or None."""
    if root is None:
        return (
            "this server writes no payloads by handle: start orchestrator-vllm with --payload-root"
        )
    if not isinstance(payload_dir, str) or not payload_dir:
        return "extra_args.payload_dir must be a non-empty string"
    if "\0" in payload_dir:
        return "extra_args.payload_dir holds a NUL character"
    if not payload_dir.startswith("/"):
        return f"extra_args.payload_dir {payload_dir!r} is not an absolute path"
    if posixpath.normpath(payload_dir) != payload_dir or payload_dir.startswith("//"):
        return (
            f"extra_args.payload_dir {payload_dir!r} is not spelled plainly "
            "(no '.', '..', doubled or trailing slashes)"
        )
    if payload_dir != root and not payload_dir.startswith(root.rstrip("/") + "/"):
        return f"extra_args.payload_dir {payload_dir!r} is outside the payload root {root!r}"
    return None


def open_payload_dir(root: str, payload_dir: str) -> tuple[int, bool]:
    """A descriptor of `payload_dir` (checked by `lexical_problem`), opened below `root`
    without following links, and whether this call created it. Raises
    `PayloadDirRefused`."""
    below = payload_dir[len(root) :].strip("/")
    parts = below.split("/") if below else []
    try:
        fd = os.open(root, _DIRECTORY)
    except OSError as exc:
        raise PayloadDirRefused(
            f"the payload root {root!r} cannot be opened: {_why(exc)}"
        ) from None
    created = False
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                child = os.open(part, _BELOW_ROOT, dir_fd=fd)
            except FileNotFoundError:
                if not last:
                    raise
                try:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    created = True
                except FileExistsError:  # another request made it meanwhile
                    pass
                child = os.open(part, _BELOW_ROOT, dir_fd=fd)
            os.close(fd)
            fd = child
    except OSError as exc:
        os.close(fd)
        where = posixpath.join(root, *parts[: i + 1])
        raise PayloadDirRefused(
            f"extra_args.payload_dir {payload_dir!r}: {where!r} {_why(exc)}"
        ) from None
    return fd, created


def write_file(dir_fd: int, arrays: Sequence[FieldArray], *, fsync: bool) -> str:
    """Write `arrays` back to back into a new file in the directory `dir_fd`; its name.
    Raises `OSError` (the file is gone then)."""
    name = f"{uuid.uuid4().hex}.bin"
    fd = os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o644,
        dir_fd=dir_fd,
    )
    try:
        for item in arrays:
            view = memoryview(item.array.data).cast("B")
            while view:
                view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    except BaseException:
        os.close(fd)
        try:
            os.unlink(name, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    os.close(fd)
    return name


def _why(exc: OSError) -> str:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return "is a symbolic link or not a directory"
    if exc.errno == errno.ENOENT:
        return "does not exist"
    return exc.strerror or str(exc)

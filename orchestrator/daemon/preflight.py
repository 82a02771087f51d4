"""Start-up checks of `orchestrator run`: everything that can fail, before anything changes.

A fresh run wipes the payload root and every run writes `progress.json` as soon as it
starts, so a failure found after that (a metrics port in use, a directory that cannot be
written) would leave damage behind a traceback. `preflight` finds those failures first,
while nothing is changed yet, and raises `UserError` (one line, exit code 2) for each:

- every directory of the run exists or can be created, and a file can be created in it
  (a real probe: root ignores permission bits, but not a read-only filesystem or a path
  below a regular file);
- the run's lock (`hold_run_lock`): one daemon per run;
- the metrics listener is bound for real, and the bound sockets are handed to the
  metrics server, so its later start cannot fail.

Blocking; call it before `trio.run`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import attrs

from orchestrator.config import Config
from orchestrator.daemon.metrics import BadListenAddress, parse_listen_address
from orchestrator.errors import UserError
from orchestrator.handoff import hold_run_lock


@attrs.frozen
class Preflight:
    """What the checks set up for the run: the bound metrics sockets (none when off)."""

    metrics_sockets: tuple[socket.socket, ...] = ()


@contextlib.contextmanager
def preflight(config: Config) -> Iterator[Preflight]:
    """Check the run's directories, hold its lock and bind its metrics listener.

    The lock is held and the sockets stay open for the duration; the sockets are closed
    at the end (a metrics server that took them over has closed them already). Raises
    `UserError` naming what is wrong and where.
    """
    check_directories(config)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(hold_run_lock(config.state_dir))
        except OSError as exc:
            raise UserError(
                f"cannot take the run's lock in {config.state_dir}: {_reason(exc)}"
            ) from None
        sockets = bind_listen_address(config.metrics.listen) if config.metrics.listen else []
        for sock in sockets:
            held.callback(sock.close)
        yield Preflight(metrics_sockets=tuple(sockets))


def check_directories(config: Config) -> None:
    """Every directory the run writes to exists or can be created, and is writable.

    The payload root itself is left alone when it does not exist (the fresh-run wipe
    creates it, and refuses a root that is not its own with its own message); its parent
    must be writable.
    """
    directories = [
        ("run_dir", config.run_dir),
        ("the daemon's state directory", config.state_dir),
        ("trainer.batches_dir", config.batches_dir),
        ("trainer.weights_dir", config.weights_dir),
        ("the parent of payload.root", config.payload_root.parent),
    ]
    root = config.payload_root
    if root.is_dir() and not root.is_symlink():
        directories.append(("payload.root", root))
    for what, path in directories:
        check_writable_directory(what, path)


def check_writable_directory(what: str, path: Path) -> None:
    """Create `path` (and its parents) if needed, then create and remove a probe file in it.

    Raises `UserError`: "<what> <path> is not a writable directory: <reason>".
    """
    try:
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".preflight-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except NotADirectoryError:
        blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise UserError(
            f"{what} {path} is not a writable directory: {blocker} is not a directory"
        ) from None
    except OSError as exc:
        # The path itself, or the probe in it, goes without saying; a parent does not.
        named = exc.filename is not None and path not in (
            Path(exc.filename),
            *Path(exc.filename).parents[:1],
        )
        reason = _reason(exc) if named else _reason(exc, with_path=False)
        raise UserError(f"{what} {path} is not a writable directory: {reason}") from None


def bind_listen_address(listen: str) -> list[socket.socket]:
    """Listening TCP sockets for `listen` ("host:port"), one per address the host resolves
    to, bound the way `trio.open_tcp_listeners` binds them.

    Raises `UserError` when the address is malformed, the host does not resolve, or no
    socket can listen there (a port in use, an address not on this machine).
    """
    shown = f'metrics.listen = "{listen}"'
    try:
        host, port = parse_listen_address(listen)
    except BadListenAddress as exc:
        raise UserError(str(exc)) from None
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        raise UserError(f"{shown}: cannot resolve the host {host!r}: {reason}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in addresses:
            try:
                sock = socket.socket(family, kind, proto)
            except OSError as exc:
                if exc.errno == errno.EAFNOSUPPORT:
                    continue  # e.g. IPv6 disabled on this host: listen on the rest
                raise
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(socket.SOMAXCONN)
        if not sockets:
            raise OSError(errno.EAFNOSUPPORT, "no usable address family")
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise UserError(f"{shown}: cannot listen there: {_reason(exc)}") from None
    return sockets


def _reason(exc: OSError, *, with_path: bool = True) -> str:
    """The error's reason, lower-cased as in a sentence, with the path it names if any."""
    reason = exc.strerror or str(exc)
    reason = reason[:1].lower() + reason[1:]
    return f"{reason} ({exc.filename})" if with_path and exc.filename else reason

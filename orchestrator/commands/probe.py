"""`check-config --probe`: each `[inference] urls` server asked, before a run, what the
run would find (issue 55: an unreachable URL otherwise costs `unavailable_deadline_s`).

A server is asked `GET /health` (200: up; vLLM answers an empty body, the local fleet its
state with the weight `version` it holds) and `GET /v1/models` (vLLM's list: the served
names, `data[].id`), with the bearer token when the config names one, each under
`PROBE_TIMEOUT_S`, all servers at once. One line per server says what it found;
`probe_servers` reports whether every server can serve this run: reachable, healthy,
serving `[inference] model` (when set), and, for a fresh run, not holding another run's
weights where it says which version it holds (a fresh run takes version 0 to be what the
servers hold and never loads it: docs/design.md §13).
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Sequence
from typing import Any

import attrs
import httpx

from orchestrator.wire import HEALTH_PATH, MODELS_PATH

#: Each request's deadline (connect and read).
PROBE_TIMEOUT_S = 2.0


@attrs.frozen
class ProbeResult:
    """What one server answered: `ok` when it can serve the run, `line` says why."""

    url: str
    ok: bool
    line: str


def probe_servers(
    urls: Sequence[str], *, model: str, authorization: str | None, fresh: bool
) -> list[ProbeResult]:
    """Probe every server of `urls` at once (threads: each waits on its sockets). `model`:
    the name the run sends ("" checks none); `fresh`: the run starts from version 0."""
    if not urls:
        return []
    headers = {"Authorization": authorization} if authorization else {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(urls))) as pool:
        return list(pool.map(lambda url: _probe(url, headers, model, fresh), urls))


def _probe(url: str, headers: dict[str, str], model: str, fresh: bool) -> ProbeResult:
    base = url.rstrip("/")
    with httpx.Client(timeout=PROBE_TIMEOUT_S, headers=headers) as client:
        try:
            health = client.get(base + HEALTH_PATH)
        except httpx.HTTPError as exc:
            return ProbeResult(url, False, f"probe {url}: unreachable: {_reason(exc)}")
        if health.status_code != 200:
            return ProbeResult(
                url, False, f"probe {url}: not healthy: /health answered {health.status_code}"
            )
        version = _held_version(health.content)
        try:
            models = client.get(base + MODELS_PATH)
        except httpx.HTTPError as exc:
            return ProbeResult(url, False, f"probe {url}: up, but /v1/models: {_reason(exc)}")
    return judge(url, version, models.status_code, models.content, model=model, fresh=fresh)


def judge(
    url: str, version: int | None, status: int, models_body: bytes, *, model: str, fresh: bool
) -> ProbeResult:
    """The verdict on a server that answered `/health` 200 (with the weight `version` it
    holds, if it says) and `/v1/models` with `status` and `models_body`. Pure."""
    held = "" if version is None else f", holds weights version {version}"
    if status == 401:
        return ProbeResult(
            url,
            False,
            f"probe {url}: up, but refuses the bearer token on /v1/models (401): "
            "set [inference] api_key_env or api_key_file",
        )
    served = _served_names(models_body) if status == 200 else None
    if served is None:
        what = f"up{held}; /v1/models answered {status}: its model is not known"
        ok = True
    elif model and model not in served:
        names = ", ".join(repr(name) for name in served) or "nothing"
        return ProbeResult(
            url, False, f"probe {url}: up, serves {names}, not [inference] model = {model!r}"
        )
    else:
        names = ", ".join(repr(name) for name in served)
        what = f"up, serves {names}{held}"
        ok = True
    if fresh and version:
        return ProbeResult(
            url,
            False,
            f"probe {url}: {what}: a fresh run takes the servers to hold version 0 and "
            "never loads it; restart the server with the base weights",
        )
    return ProbeResult(url, ok, f"probe {url}: {what}")


def _held_version(body: bytes) -> int | None:
    """The weight version a `/health` body says the server holds (the local fleet's
    `version`; vLLM's empty body says nothing)."""
    try:
        state: Any = json.loads(body)
    except ValueError:
        return None
    version = state.get("version") if isinstance(state, dict) else None
    return version if isinstance(version, int) and not isinstance(version, bool) else None


def _served_names(body: bytes) -> list[str] | None:
    try:
        listing: Any = json.loads(body)
    except ValueError:
        return None
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        return None
    return [str(entry["id"]) for entry in data if isinstance(entry, dict) and "id" in entry]


def _reason(exc: httpx.HTTPError) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {PROBE_TIMEOUT_S:g} s"
    if isinstance(exc, httpx.ConnectError):
        text = str(exc)
        return "connection refused" if "refused" in text.lower() else f"cannot connect: {text}"
    return f"{type(exc).__name__}: {exc}"

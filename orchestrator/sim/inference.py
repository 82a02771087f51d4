"""One simulated inference server: the docs/design.md §4 HTTP API over the deterministic model.

`serve_inference` runs a hypercorn server on trio until cancelled:

- `POST /inference/v1/generate`: completions, with routed experts and sampling masks by
  handle (a file per choice under the request's `payload_dir`, closed before replying)
  or inline (base64 in the body);
- `POST /update_weights`: record a new weight directory and the version it names;
- `GET /health`: served version, request counts, injected faults, payload bytes written.

Latency and faults are configurable, and faults are drawn from a seeded generator, so a
test or a demo can reproduce a flaky fleet.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any, cast

import attrs
import numpy as np
import structlog
import trio

from orchestrator.payload import write_payload
from orchestrator.wire import GENERATE_PATH, HEALTH_PATH, UPDATE_WEIGHTS_PATH

from ._asgi import (
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    read_body,
    send_bytes,
    send_json,
    serve_lifespan,
    wait_for_disconnect,
)
from ._faults import Fault, FaultRates, draw_fault
from ._model import Generation, SimModel, generate, prefix_hashes
from ._prefix_cache import PrefixCache
from ._response import (
    corrupt_segment,
    inline_payload,
    payload_arrays,
    render_choice,
    render_response,
    segments_payload,
)
from ._wire import BadRequest, GenerateRequest, parse_generate_request, parse_weight_update

__all__ = ["SimInferenceConfig", "serve_inference"]

log = structlog.get_logger("orchestrator.sim.inference")

# 8,000 prompt tokens are ~50 kB of JSON; anything near this is a client bug.
_MAX_BODY_BYTES = 64 * 2**20


def _non_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must not be negative, got {value}")


@attrs.frozen
class SimInferenceConfig:
    """Everything one simulated server needs; the defaults are a quiet, fast server.

    - `model`: the simulated model's shape (48 layers, top-8 of 128 experts by default).
    - `host`, `port`: where to listen; port 0 picks a free port (reported on start).
    - `time_per_token_s`, `request_overhead_s`: the latency model, slept per request:
      overhead + time per token x the longest choice (choices decode in parallel).
    - `weight_update_s`: how long `/update_weights` takes.
    - `faults`, `fault_seed`: fault rates and the seed of the generator they are drawn from.
    - `fsync`: fsync each payload file before closing it.
    - `prefix_cache_blocks`: prefix cache capacity in blocks of `model.block_size` tokens.
    - `max_model_len`: longest prompt + max_tokens accepted.
    - `worker_threads`: bound on concurrent model computations and on concurrent writes.

    Raises `ValueError` from the constructor when a field is out of range.
    """

    model: SimModel = attrs.field(factory=SimModel)
    host: str = "127.0.0.1"
    port: int = attrs.field(
        default=0, validator=[attrs.validators.ge(0), attrs.validators.le(65535)]
    )
    time_per_token_s: float = attrs.field(default=0.0, validator=_non_negative)
    request_overhead_s: float = attrs.field(default=0.0, validator=_non_negative)
    weight_update_s: float = attrs.field(default=0.0, validator=_non_negative)
    faults: FaultRates = attrs.field(factory=FaultRates)
    fault_seed: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    fsync: bool = False
    prefix_cache_blocks: int = attrs.field(default=65536, validator=attrs.validators.ge(0))
    max_model_len: int = attrs.field(default=65536, validator=attrs.validators.ge(2))
    worker_threads: int = attrs.field(default=4, validator=attrs.validators.ge(1))


@attrs.define
class _ServerState:
    """What one server remembers between requests (touched only from its event loop)."""

    config: SimInferenceConfig
    prefix_cache: PrefixCache
    fault_rng: np.random.Generator
    compute_limiter: trio.CapacityLimiter
    write_limiter: trio.CapacityLimiter
    version: int = 0
    weight_dir: str | None = None
    requests_served: int = 0
    in_flight: int = 0
    faults_served: Counter[str] = attrs.Factory(Counter)
    payload_files: int = 0
    payload_bytes: int = 0

    @classmethod
    def fresh(cls, config: SimInferenceConfig) -> _ServerState:
        return cls(
            config=config,
            prefix_cache=PrefixCache(config.model.block_size, config.prefix_cache_blocks),
            fault_rng=np.random.default_rng(config.fault_seed),
            compute_limiter=trio.CapacityLimiter(config.worker_threads),
            write_limiter=trio.CapacityLimiter(config.worker_threads),
        )

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "version": self.version,
            "weight_dir": self.weight_dir,
            "requests_served": self.requests_served,
            "in_flight": self.in_flight,
            "faults": {fault.value: self.faults_served[fault.value] for fault in Fault},
            "payload_files_written": self.payload_files,
            "payload_bytes_written": self.payload_bytes,
            "prefix_cache_blocks": len(self.prefix_cache),
        }


def _generate_all(
    model: SimModel, request: GenerateRequest, routing_start: int
) -> list[Generation]:
    """Every choice of a request (CPU-bound numpy: runs in a worker thread)."""
    prompt = np.asarray(request.token_ids, dtype=np.int64)
    hashes = prefix_hashes(prompt)
    return [
        generate(model, prompt, hashes, request.sampling, index, routing_start)
        for index in range(request.n)
    ]


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


@attrs.frozen
class _InferenceApp:
    """The ASGI application: routes requests to handlers over one `_ServerState`."""

    state: _ServerState

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        route = (scope["method"], scope["path"])
        if route == ("POST", GENERATE_PATH):
            await self._generate(receive, send)
        elif route == ("POST", UPDATE_WEIGHTS_PATH):
            await self._update_weights(receive, send)
        elif route == ("GET", HEALTH_PATH):
            await send_json(send, 200, self.state.health())
        elif scope["path"] in (GENERATE_PATH, UPDATE_WEIGHTS_PATH, HEALTH_PATH):
            await send_json(send, 405, {"error": f"method {scope['method']} not allowed"})
        else:
            await send_json(send, 404, {"error": f"no route {scope['path']}"})

    async def _body(self, receive: Receive, send: Send) -> bytes | None:
        """The request body, or None after answering 413 (or seeing the client leave)."""
        try:
            return await read_body(receive, limit=_MAX_BODY_BYTES)
        except ClientGone:
            return None
        except BodyTooLarge:
            await send_json(send, 413, {"error": f"body larger than {_MAX_BODY_BYTES} bytes"})
            return None

    async def _update_weights(self, receive: Receive, send: Send) -> None:
        body = await self._body(receive, send)
        if body is None:
            return
        try:
            update = parse_weight_update(body)
        except BadRequest as exc:
            await send_json(send, 400, {"error": str(exc)})
            return
        await trio.sleep(self.state.config.weight_update_s)
        state = self.state
        state.weight_dir = update.weight_dir
        if update.version is not None:
            state.version = update.version
        # New weights route differently: every cached prefix is stale, as in vLLM.
        state.prefix_cache.clear()
        log.info("weights updated", weight_dir=update.weight_dir, version=update.version)
        await send_json(send, 200, {"weight_dir": update.weight_dir, "version": update.version})

    async def _generate(self, receive: Receive, send: Send) -> None:
        body = await self._body(receive, send)
        if body is None:
            return
        state = self.state
        state.in_flight += 1
        try:
            status, payload = await self._answer_generate(body, receive)
            if status is not None:
                await send_bytes(send, status, payload)
        finally:
            state.in_flight -= 1
            state.requests_served += 1

    async def _answer_generate(self, body: bytes, receive: Receive) -> tuple[int | None, bytes]:
        """Status and body for a generate request (status None: the client gave up)."""
        state, config = self.state, self.state.config
        try:
            request = parse_generate_request(body, config.model, max_model_len=config.max_model_len)
        except BadRequest as exc:
            return 400, _encode({"error": str(exc)})
        draw = draw_fault(state.fault_rng, config.faults, by_handle=request.payload_dir is not None)
        if draw.fault is Fault.HTTP_500:
            state.faults_served[Fault.HTTP_500.value] += 1
            return 500, _encode({"error": "simulated internal server error"})
        if draw.fault is Fault.HANG:
            state.faults_served[Fault.HANG.value] += 1
            await wait_for_disconnect(receive)
            return None, b""

        prompt_len = len(request.token_ids)
        prompt_hashes = prefix_hashes(np.asarray(request.token_ids, dtype=np.int64))
        routing_start = state.prefix_cache.cached_prefix_len(prompt_hashes, prompt_len)
        generations = await trio.to_thread.run_sync(
            functools.partial(_generate_all, config.model, request, routing_start),
            limiter=state.compute_limiter,
        )
        for generation in generations:
            # The last sampled token was never run forward, so it is not cached either.
            computed = generation.sequence_hashes.shape[0] - 1
            state.prefix_cache.remember(generation.sequence_hashes, computed)
        longest = max(len(g.completion.token_ids) for g in generations)
        await trio.sleep(config.request_overhead_s + config.time_per_token_s * longest)

        choices = [
            await self._choice(request, index, generation, draw.fault, draw.variant)
            for index, generation in enumerate(generations)
        ]
        response = render_response(request.request_id, choices, prompt_len)
        encoded = await trio.to_thread.run_sync(_encode, response, limiter=state.compute_limiter)
        if draw.fault is Fault.MALFORMED:
            state.faults_served[Fault.MALFORMED.value] += 1
            return 200, encoded[: len(encoded) // 2]
        log.debug(
            "generated",
            request_id=request.request_id,
            prompt_len=prompt_len,
            routing_start=routing_start,
            choices=len(choices),
            by_handle=request.payload_dir is not None,
            response_bytes=len(encoded),
        )
        return 200, encoded

    async def _choice(
        self,
        request: GenerateRequest,
        index: int,
        generation: Generation,
        fault: Fault | None,
        variant: float,
    ) -> dict[str, Any]:
        """One rendered choice, its payload written by handle or encoded inline."""
        state = self.state
        prompt_len = len(request.token_ids)
        arrays = payload_arrays(
            generation,
            prompt_len,
            routed_experts=request.return_routed_experts,
            sampling_mask=request.return_sampling_mask,
        )
        if request.payload_dir is None:
            payload = await trio.to_thread.run_sync(
                inline_payload, arrays, limiter=state.compute_limiter
            )
            return render_choice(index, generation, prompt_len, payload)
        if not arrays:
            return render_choice(index, generation, prompt_len, segments_payload([]))
        # Faults hit the first choice only: a request with several choices then has a
        # poisoned rollout next to healthy ones, the case the orchestrator must keep apart.
        if fault is Fault.PAYLOAD_ERROR and index == 0:
            state.faults_served[Fault.PAYLOAD_ERROR.value] += 1
            error = "simulated payload write failure (injected fault)"
            return render_choice(index, generation, prompt_len, {"payload_error": error})
        try:
            segments = await write_payload(
                Path(request.payload_dir),
                arrays,
                fsync=state.config.fsync,
                limiter=state.write_limiter,
            )
        except (OSError, ValueError) as exc:
            log.warning("payload write failed", request_id=request.request_id, error=str(exc))
            error = f"{type(exc).__name__}: {exc}"
            return render_choice(index, generation, prompt_len, {"payload_error": error})
        file_size = sum(segment.nbytes for segment in segments)
        state.payload_files += 1
        state.payload_bytes += file_size
        if fault is Fault.BAD_SEGMENT and index == 0:
            state.faults_served[Fault.BAD_SEGMENT.value] += 1
            segments[0] = corrupt_segment(segments[0], file_size, variant)
        return render_choice(index, generation, prompt_len, segments_payload(segments))


async def serve_inference(
    config: SimInferenceConfig,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve one simulated inference server until cancelled.

    Reports readiness with `task_status.started(url)`, the URL carrying the real port
    when `config.port` is 0: `url = await nursery.start(serve_inference, config)`.
    Raises `OSError` when the address cannot be bound.
    """
    # Imported here: the CLI builds its parser from every command module, and hypercorn
    # is only needed by a process that actually serves.
    from hypercorn.config import Config as HypercornConfig
    from hypercorn.trio import serve
    from hypercorn.typing import ASGIFramework

    hypercorn_config = HypercornConfig()
    hypercorn_config.bind = [f"{config.host}:{config.port}"]
    hypercorn_config.accesslog = None
    # Through stdlib logging, which `configure_logging` renders like everything else.
    hypercorn_config.errorlog = logging.getLogger("hypercorn.error")
    # The app speaks plain-dict ASGI (see _asgi.py) rather than hypercorn's TypedDicts.
    app = cast("ASGIFramework", _InferenceApp(_ServerState.fresh(config)))
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(functools.partial(serve, app, hypercorn_config))
        url = binds[0]
        log.info("inference server listening", url=url, model=attrs.asdict(config.model))
        task_status.started(url)

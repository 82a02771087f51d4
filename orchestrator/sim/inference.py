"""One simulated inference server: vLLM's tokens-in/tokens-out API over the deterministic model.

`serve_inference` runs a hypercorn server on trio until cancelled:

- `POST /inference/v1/generate`: vLLM's `GenerateRequest` (orchestrator.sim._wire),
  answered in the form of the server family `reply_form` names (orchestrator.sim.
  _response): prime-rl's extension (packed arrays inline, or with
  `sampling_params.extra_args.payload_dir` one file per choice written there, closed
  before replying, and segments naming it) or upstream vLLM (`.npy` routing and mask
  lists inline; `payload_dir` is ignored, as upstream ignores it). Whether routing and
  masks are captured is a server setting, as in vLLM; routing rows run from the request's
  `routed_experts_prompt_start` to the last token run forward;
- `POST /update_weights`: record a new weight directory and the version it names;
- `GET /health`: served version, request counts, injected faults, payload bytes written.

A server may also be one side of disaggregated prefill/decode (`role`): a prefill server
answers only requests a P/D router prepared and announces the prompt's KV blocks in
`kv_transfer_params`; a decode server needs those blocks and runs forward from the
prompt's last token only, so its routing rows start there (padded with zero rows up to
`routed_experts_prompt_start` inline, as prime-rl pads them for the router).
`disaggregated = true` serves a whole P/D deployment instead: a router in front of a
prefill and a decode server (orchestrator.sim.pd_router).

Errors take vLLM's `ErrorResponse` shape. Latency and faults are configurable, and faults
are drawn from a seeded generator, so a test or a demo can reproduce a flaky fleet.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Literal, cast

import attrs
import numpy as np
import numpy.typing as npt
import structlog
import trio

from orchestrator.payload import write_payload
from orchestrator.wire.segments import segment_to_wire

from ._asgi import (
    Receive,
    Scope,
    Send,
    send_bytes,
    send_json,
    wait_for_disconnect,
)
from ._faults import Fault, FaultRates, draw_fault
from ._model import Generation, SimModel, generate, prefix_hashes
from ._pd import (
    SIM_ROLES,
    SimRole,
    check_decode_request,
    check_prefill_request,
    kv_block_ids,
    pad_rows,
    prefill_kv_transfer_params,
)
from ._response import (
    corrupt_segment,
    error_body,
    narrow_routing,
    primerl_choice,
    render_response,
    upstream_choice,
)
from ._routes import request_body, route_request, send_error
from ._wire import GenerateRequest, RequestRefused, parse_generate_request, parse_weight_update

__all__ = [
    "DEFAULT_SERVED_MODEL_NAME",
    "REPLY_FORMS",
    "ReplyForm",
    "SimInferenceConfig",
    "serve_inference",
]

log = structlog.get_logger("orchestrator.sim.inference")

#: The reply forms a server can answer in: prime-rl's vLLM extension, or vLLM as released.
ReplyForm = Literal["prime-rl", "upstream"]
REPLY_FORMS: tuple[ReplyForm, ...] = ("prime-rl", "upstream")
#: The model name a server answers to unless told otherwise.
DEFAULT_SERVED_MODEL_NAME = "sim-moe"


def _non_negative(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must not be negative, got {value}")


def _reply_form(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in REPLY_FORMS:
        raise ValueError(f"{attribute.name} must be one of {', '.join(REPLY_FORMS)}, got {value!r}")


def _role(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if value not in SIM_ROLES:
        raise ValueError(f"{attribute.name} must be one of {', '.join(SIM_ROLES)}, got {value!r}")


def _model_name(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not value:
        raise ValueError(f"{attribute.name} must not be empty")


@attrs.frozen
class SimInferenceConfig:
    """Everything one simulated server needs; the defaults are a quiet, fast server.

    - `model`: the simulated model's shape (48 layers, top-8 of 128 experts by default).
    - `served_model_name`: the name a request's `model` must match (else 404, as vLLM).
    - `host`, `port`: where to listen; port 0 picks a free port (reported on start).
    - `reply_form`: "prime-rl" (packed inline, or by handle) or "upstream" (vLLM's own
      form, always inline).
    - `capture_routed_experts`, `capture_sampling_mask`: whether replies carry routing and
      masks (vLLM's `enable_return_routed_experts` and its like: server settings).
    - `payload_digests`: by handle, add each segment's `digest` (this project's extension).
    - `time_per_token_s`, `request_overhead_s`: the latency model, slept per request:
      overhead + time per token x the longest choice (choices decode in parallel).
    - `max_num_seqs`: requests generated at once (vLLM's engine setting of that name);
      the rest wait their turn, so past it turnaround grows with the requests sent.
      0: no bound.
    - `weight_update_s`: how long `/update_weights` takes.
    - `faults`, `fault_seed`: fault rates and the seed of the generator they are drawn from.
    - `fsync`: fsync each payload file before closing it.
    - `max_model_len`: longest prompt + max_tokens accepted; an absent `max_tokens` is
      what the prompt leaves of it.
    - `worker_threads`: bound on concurrent model computations and on concurrent writes.
    - `role`: "aggregated" (a whole server), or one side of disaggregated prefill/decode,
      "prefill" or "decode" (see the module docstring).
    - `disaggregated`: serve a P/D deployment on `host:port` (a router in front of a
      prefill and a decode server, each with this config's other settings; their faults
      drawn from seeds `2 * fault_seed` and `2 * fault_seed + 1`).

    Raises `ValueError` from the constructor when a field is out of range.
    """

    model: SimModel = attrs.field(factory=SimModel)
    served_model_name: str = attrs.field(default=DEFAULT_SERVED_MODEL_NAME, validator=_model_name)
    host: str = "127.0.0.1"
    port: int = attrs.field(
        default=0, validator=[attrs.validators.ge(0), attrs.validators.le(65535)]
    )
    reply_form: ReplyForm = attrs.field(default="prime-rl", validator=_reply_form)
    capture_routed_experts: bool = True
    capture_sampling_mask: bool = True
    payload_digests: bool = False
    time_per_token_s: float = attrs.field(default=0.0, validator=_non_negative)
    request_overhead_s: float = attrs.field(default=0.0, validator=_non_negative)
    weight_update_s: float = attrs.field(default=0.0, validator=_non_negative)
    faults: FaultRates = attrs.field(factory=FaultRates)
    fault_seed: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    fsync: bool = False
    max_model_len: int = attrs.field(default=65536, validator=attrs.validators.ge(2))
    worker_threads: int = attrs.field(default=4, validator=attrs.validators.ge(1))
    role: SimRole = attrs.field(default="aggregated", validator=_role)
    disaggregated: bool = False
    max_num_seqs: int = attrs.field(default=0, validator=attrs.validators.ge(0))

    def __attrs_post_init__(self) -> None:
        if self.disaggregated and self.role != "aggregated":
            raise ValueError(
                f"role {self.role!r} is one side of a P/D deployment; disaggregated serves both"
            )


@attrs.define
class _ServerState:
    """What one server remembers between requests (touched only from its event loop)."""

    config: SimInferenceConfig
    fault_rng: np.random.Generator
    compute_limiter: trio.CapacityLimiter
    write_limiter: trio.CapacityLimiter
    seq_limiter: trio.CapacityLimiter  # max_num_seqs (inf: no bound)
    version: int = 0
    weight_dir: str | None = None
    requests_served: int = 0
    in_flight: int = 0
    running: int = 0
    faults_served: Counter[str] = attrs.Factory(Counter)
    payload_files: int = 0
    payload_bytes: int = 0
    # Where the server listens (known once bound) and the engine id a prefill announces.
    url: str = ""
    engine_id: str = attrs.Factory(lambda: uuid.uuid4().hex)

    @classmethod
    def fresh(cls, config: SimInferenceConfig) -> _ServerState:
        return cls(
            config=config,
            fault_rng=np.random.default_rng(config.fault_seed),
            compute_limiter=trio.CapacityLimiter(config.worker_threads),
            write_limiter=trio.CapacityLimiter(config.worker_threads),
            seq_limiter=trio.CapacityLimiter(config.max_num_seqs or math.inf),
        )

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "role": self.config.role,
            "model": self.config.served_model_name,
            "version": self.version,
            "weight_dir": self.weight_dir,
            "requests_served": self.requests_served,
            "in_flight": self.in_flight,
            # Of those, generating now (at most max_num_seqs); the rest wait their turn.
            "running": self.running,
            "faults": {fault.value: self.faults_served[fault.value] for fault in Fault},
            "payload_files_written": self.payload_files,
            "payload_bytes_written": self.payload_bytes,
        }


def _generate_all(
    model: SimModel, request: GenerateRequest, routing: bool, role: SimRole
) -> list[Generation]:
    """Every choice of a request (CPU-bound numpy: runs in a worker thread). A decode
    server runs forward from the prompt's last token (its KV came from the prefill), so
    its routing rows start there whatever the request asked."""
    prompt = np.asarray(request.token_ids, dtype=np.int64)
    hashes = prefix_hashes(prompt)
    start = request.routing_start if role != "decode" else len(prompt) - 1
    return [
        generate(model, prompt, hashes, request.sampling, index, start if routing else None)
        for index in range(request.n)
    ]


def _inline_routing(
    generation: Generation, request: GenerateRequest
) -> npt.NDArray[np.unsignedinteger] | None:
    """The rows a choice carries inline: from the requested start (a decode server's
    padded with zero rows up to it)."""
    if generation.routed_experts is None:
        return None
    return pad_rows(generation.routed_experts, generation.routing_start, request.routing_start)


def _inline_choices(
    config: SimInferenceConfig, request: GenerateRequest, generations: list[Generation]
) -> list[dict[str, Any]]:
    """Every choice of an inline reply (base64 of whole arrays: runs in a worker thread)."""
    mask_on = config.capture_sampling_mask
    rows = [_inline_routing(g, request) for g in generations]
    if config.reply_form == "upstream":
        return [
            upstream_choice(
                index,
                g.completion,
                logprobs=request.logprobs,
                routing=routing,
                mask=g.completion.sampling_mask if mask_on else None,
            )
            for index, (g, routing) in enumerate(zip(generations, rows, strict=True))
        ]
    return [
        primerl_choice(
            index,
            g.completion,
            logprobs=request.logprobs,
            routing=(None if routing is None else (narrow_routing(routing), request.routing_start)),
            mask=g.completion.sampling_mask if mask_on else None,
        )
        for index, (g, routing) in enumerate(zip(generations, rows, strict=True))
    ]


def _encode(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


@attrs.frozen
class _InferenceApp:
    """The ASGI application: routes requests to handlers over one `_ServerState`."""

    state: _ServerState

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await route_request(
            scope,
            receive,
            send,
            generate=self._generate,
            update_weights=self._update_weights,
            health=self._health,
        )

    async def _health(self, send: Send) -> None:
        await send_json(send, 200, self.state.health())

    async def _update_weights(self, receive: Receive, send: Send) -> None:
        body = await request_body(receive, send)
        if body is None:
            return
        try:
            update = parse_weight_update(body)
        except RequestRefused as exc:
            await send_error(send, exc.status, str(exc))
            return
        await trio.sleep(self.state.config.weight_update_s)
        state = self.state
        state.weight_dir = update.weight_dir
        if update.version is not None:
            state.version = update.version
        log.info("weights updated", weight_dir=update.weight_dir, version=update.version)
        await send_json(send, 200, {"weight_dir": update.weight_dir, "version": update.version})

    async def _generate(self, receive: Receive, send: Send) -> None:
        body = await request_body(receive, send)
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
            request = parse_generate_request(
                body,
                config.model,
                max_model_len=config.max_model_len,
                served_model_name=config.served_model_name,
            )
            kv_transfer_params = self._check_role(request)
        except RequestRefused as exc:
            return exc.status, _encode(error_body(exc.status, str(exc)))
        # Upstream vLLM has no by-handle mode: it ignores payload_dir and answers inline.
        payload_dir = request.payload_dir if config.reply_form == "prime-rl" else None
        draw = draw_fault(state.fault_rng, config.faults, by_handle=payload_dir is not None)
        if draw.fault is Fault.HTTP_500:
            state.faults_served[Fault.HTTP_500.value] += 1
            message = "simulated internal server error (injected fault)"
            return 500, _encode(error_body(500, message))
        if draw.fault is Fault.HANG:
            state.faults_served[Fault.HANG.value] += 1
            await wait_for_disconnect(receive)
            return None, b""

        async with state.seq_limiter:
            state.running += 1
            try:
                generations = await trio.to_thread.run_sync(
                    functools.partial(
                        _generate_all,
                        config.model,
                        request,
                        config.capture_routed_experts,
                        config.role,
                    ),
                    limiter=state.compute_limiter,
                )
                longest = max(len(g.completion.token_ids) for g in generations)
                await trio.sleep(config.request_overhead_s + config.time_per_token_s * longest)
            finally:
                state.running -= 1

        if payload_dir is None:
            choices = await trio.to_thread.run_sync(
                _inline_choices, config, request, generations, limiter=state.compute_limiter
            )
        else:
            choices = [
                await self._by_handle_choice(
                    request, payload_dir, index, generation, draw.fault, draw.variant
                )
                for index, generation in enumerate(generations)
            ]
        prompt_len = len(request.token_ids)
        response = render_response(
            request.request_id, choices, prompt_len, kv_transfer_params=kv_transfer_params
        )
        encoded = await trio.to_thread.run_sync(_encode, response, limiter=state.compute_limiter)
        if draw.fault is Fault.MALFORMED:
            state.faults_served[Fault.MALFORMED.value] += 1
            return 200, encoded[: len(encoded) // 2]
        log.debug(
            "generated",
            request_id=request.request_id,
            prompt_len=prompt_len,
            routing_start=request.routing_start,
            choices=len(choices),
            by_handle=payload_dir is not None,
            response_bytes=len(encoded),
        )
        return 200, encoded

    def _check_role(self, request: GenerateRequest) -> dict[str, Any] | None:
        """Refuse a request this server's P/D role cannot serve (`BadRequest`); the
        `kv_transfer_params` of the reply (a prefill's KV blocks, else None)."""
        role = self.state.config.role
        if role == "aggregated":
            return None
        blocks = kv_block_ids(prefix_hashes(np.asarray(request.token_ids, dtype=np.int64)))
        if role == "decode":
            check_decode_request(request.kv_transfer_params, blocks)
            return None
        check_prefill_request(request.kv_transfer_params)
        host, _, port = self.state.url.removeprefix("http://").rpartition(":")
        return prefill_kv_transfer_params(self.state.engine_id, host, int(port or 0), blocks)

    async def _by_handle_choice(
        self,
        request: GenerateRequest,
        payload_dir: Path,
        index: int,
        generation: Generation,
        fault: Fault | None,
        variant: float,
    ) -> dict[str, Any]:
        """One choice by handle: routing then mask written into one new file, segments in
        the reply (`"payload": []` and no file when nothing is captured)."""
        state, config = self.state, self.state.config
        completion = generation.completion
        arrays: dict[str, tuple[np.ndarray, int]] = {}
        if generation.routed_experts is not None:
            arrays["routed_experts"] = (
                narrow_routing(generation.routed_experts),
                generation.routing_start,
            )
        if config.capture_sampling_mask:
            arrays["sampling_mask"] = (completion.sampling_mask, len(request.token_ids))
        choice = functools.partial(primerl_choice, index, completion, logprobs=request.logprobs)
        if not arrays:
            return choice(payload=[])
        # Faults hit the first choice only: a request with several choices then has a
        # poisoned rollout next to healthy ones, the case the orchestrator must keep apart.
        if fault is Fault.PAYLOAD_ERROR and index == 0:
            state.faults_served[Fault.PAYLOAD_ERROR.value] += 1
            return choice(payload_error="simulated payload write failure (injected fault)")
        try:
            segments = await write_payload(
                payload_dir, arrays, fsync=config.fsync, limiter=state.write_limiter
            )
        except (OSError, ValueError) as exc:
            log.warning("payload write failed", request_id=request.request_id, error=str(exc))
            return choice(payload_error=f"{type(exc).__name__}: {exc}")
        file_size = sum(segment.nbytes for segment in segments)
        state.payload_files += 1
        state.payload_bytes += file_size
        wire = [
            segment_to_wire(segment, payload_dir, digest=config.payload_digests)
            for segment in segments
        ]
        if fault is Fault.BAD_SEGMENT and index == 0:
            state.faults_served[Fault.BAD_SEGMENT.value] += 1
            wire[0] = corrupt_segment(wire[0], payload_dir, file_size, variant)
        return choice(payload=wire)


async def serve_inference(
    config: SimInferenceConfig,
    *,
    task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve one simulated inference server until cancelled.

    Reports readiness with `task_status.started(url)`, the URL carrying the real port
    when `config.port` is 0: `url = await nursery.start(serve_inference, config)`. With
    `config.disaggregated` it serves a P/D deployment and reports its router's URL.
    Raises `OSError` when the address cannot be bound.
    """
    if config.disaggregated:
        from orchestrator.sim.pd_router import serve_pd_deployment

        await serve_pd_deployment(config, task_status=task_status)
        return
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
    state = _ServerState.fresh(config)
    app = cast("ASGIFramework", _InferenceApp(state))
    async with trio.open_nursery() as nursery:
        binds: list[str] = await nursery.start(functools.partial(serve, app, hypercorn_config))
        url = state.url = binds[0]
        log.info(
            "inference server listening",
            url=url,
            role=config.role,
            served_model_name=config.served_model_name,
            reply_form=config.reply_form,
            model=attrs.asdict(config.model),
        )
        task_status.started(url)

"""One simulated inference server: vLLM's tokens-in/tokens-out API over the deterministic model.

`serve_inference` runs a hypercorn server on trio until cancelled
(`orchestrator.asgi_server.serve_asgi`):

- `POST /inference/v1/generate`: vLLM's `GenerateRequest` (orchestrator.sim._wire),
  answered in the reply form `reply_form` names (orchestrator.sim.reply_forms):
  prime-rl's extension (packed arrays inline, or with
  `sampling_params.extra_args.payload_dir` one file per choice written there, closed
  before replying, and segments naming it) or upstream vLLM (`.npy` routing and mask
  lists inline; `payload_dir` is ignored, as upstream ignores it). Whether routing and
  masks are captured is a server setting, as in vLLM; routing rows run from the request's
  `routed_experts_prompt_start` to the last token run forward;
- `POST /update_weights`: record a new weight directory and the version it names;
- `GET /health`: served version, request counts, injected faults, payload bytes written;
- `GET /version`: the vLLM release it passes for, `{"version": vllm_version}`.

A server may also be one side of disaggregated prefill/decode (`role`): a prefill server
answers only requests a P/D router prepared and announces the prompt's KV blocks in
`kv_transfer_params`; a decode server needs those blocks and runs forward from the
prompt's last token only, so its routing rows start there (padded with zero rows up to
`routed_experts_prompt_start` inline, as prime-rl pads them for the router).
`disaggregated = true` serves a whole P/D deployment instead (`serve_pd_deployment`): a
router (orchestrator.sim.pd_router) in front of a prefill and a decode server.

Errors take vLLM's `ErrorResponse` shape. Latency and faults are configurable, and faults
are drawn from a seeded generator, so a test or a demo can reproduce a flaky fleet.
"""

from __future__ import annotations

import contextlib
import functools
import json
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import structlog
import trio

from orchestrator.asgi_server import (
    Receive,
    Scope,
    Send,
    send_bytes,
    send_json,
    serve_asgi,
    wait_for_disconnect,
)
from orchestrator.fair_budget import FairBudget
from orchestrator.payload import write_payload
from orchestrator.wire import VLLM_DEV_PATHS
from orchestrator.wire.errors import error_body
from orchestrator.wire.segments import segment_to_wire

from ._faults import Fault, draw_fault
from ._model import Generation, SimModel, generate, prefix_hashes
from ._pd import (
    SimRole,
    check_decode_request,
    check_prefill_request,
    kv_block_ids,
    pad_rows,
    prefill_kv_transfer_params,
)
from ._response import corrupt_segment, render_response
from ._routes import Handler, request_body, route_request, send_error
from ._server_config import DEFAULT_SERVED_MODEL_NAME, SimInferenceConfig
from ._wire import (
    BadRequest,
    GenerateRequest,
    RequestRefused,
    parse_collective_rpc,
    parse_generate_request,
    parse_new_version,
    parse_weight_update,
)
from .pd_router import PDRouterConfig, serve_pd_router
from .reply_forms import REPLY_FORMS, ByHandleForm, ReplyForm, RoutingIds

__all__ = [
    "DEFAULT_SERVED_MODEL_NAME",
    "SimInferenceConfig",
    "serve_inference",
    "serve_pd_deployment",
]

log = structlog.get_logger(__name__)


@attrs.define
class _Sequences:
    """vLLM's `max_num_seqs`: the sequences generated at once, a request's `n` choices
    counting as `n` (vLLM runs each choice as a request of its own); the rest wait, first
    come first served (`free` None: no bound)."""

    free: FairBudget | None
    running: int = 0

    @classmethod
    def bounded(cls, max_num_seqs: int) -> _Sequences:
        return cls(FairBudget(max_num_seqs) if max_num_seqs else None)

    @contextlib.asynccontextmanager
    async def held(self, n: int) -> AsyncIterator[None]:
        """`n` sequences while the body runs (`n` at most the bound)."""
        if self.free is not None:
            await self.free.reserve(n)
        self.running += n
        try:
            yield
        finally:
            self.running -= n
            if self.free is not None:
                self.free.release(n)


@attrs.define
class _ServerState:
    """What one server remembers between requests (touched only from its event loop)."""

    config: SimInferenceConfig
    form: ReplyForm
    fault_rng: np.random.Generator
    compute_limiter: trio.CapacityLimiter
    write_limiter: trio.CapacityLimiter
    sequences: _Sequences  # max_num_seqs
    version: int = 0
    weight_dir: str | None = None
    requests_served: int = 0
    # Generate requests that named a payload directory (asked for payloads by handle).
    payload_requests: int = 0
    in_flight: int = 0
    faults_served: Counter[str] = attrs.Factory(Counter)
    payload_files: int = 0
    payload_bytes: int = 0
    # Where the server listens (known once bound) and the engine id a prefill announces.
    url: str = ""
    engine_id: str = attrs.Factory(lambda: uuid.uuid4().hex)
    # Upstream vLLM's /pause (mode "keep"): generate requests wait until /resume.
    paused: bool = False
    resumed: trio.Event = attrs.Factory(trio.Event)

    @classmethod
    def fresh(cls, config: SimInferenceConfig) -> _ServerState:
        return cls(
            config=config,
            form=REPLY_FORMS[config.reply_form],
            fault_rng=np.random.default_rng(config.fault_seed),
            compute_limiter=trio.CapacityLimiter(config.worker_threads),
            write_limiter=trio.CapacityLimiter(config.worker_threads),
            sequences=_Sequences.bounded(config.max_num_seqs),
        )

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "role": self.config.role,
            "model": self.config.served_model_name,
            "version": self.version,
            "weight_dir": self.weight_dir,
            "requests_served": self.requests_served,
            "payload_requests": self.payload_requests,
            "in_flight": self.in_flight,
            # Of those, generating now (at most max_num_seqs); the rest wait their turn.
            "running": self.sequences.running,
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


def _inline_routing(generation: Generation, request: GenerateRequest) -> RoutingIds | None:
    """The rows a choice carries inline: from the requested start (a decode server's
    padded with zero rows up to it)."""
    if generation.routed_experts is None:
        return None
    return pad_rows(generation.routed_experts, generation.routing_start, request.routing_start)


def _inline_choices(
    form: ReplyForm, mask_on: bool, request: GenerateRequest, generations: list[Generation]
) -> list[dict[str, Any]]:
    """Every choice of an inline reply (base64 of whole arrays: runs in a worker thread)."""
    return [
        form.inline_choice(
            index,
            g.completion,
            logprobs=request.logprobs,
            routing=_inline_routing(g, request),
            routing_start=request.routing_start,
            mask=g.completion.sampling_mask if mask_on else None,
        )
        for index, g in enumerate(generations)
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
            control=self._vllm_dev_endpoints()
            if self.state.config.reply_form == "upstream"
            else None,
            api_key=self.state.config.api_key,
            version=self.state.config.vllm_version,
            models=self._models(),
        )

    def _models(self) -> dict[str, Any]:
        # vLLM's `GET /v1/models` for one served model (its OpenAI-compatible list).
        config = self.state.config
        model = {
            "id": config.served_model_name,
            "object": "model",
            "owned_by": "vllm",
            "root": config.served_model_name,
            "max_model_len": config.max_model_len,
        }
        return {"object": "list", "data": [model]}

    def _vllm_dev_endpoints(self) -> dict[str, Handler]:
        """Upstream vLLM's weight-update endpoints of its dev mode, as 0.30.0 answers
        them (orchestrator/wire/weight_updates.py sends them)."""
        handlers = (
            self._pause,
            self._collective_rpc,
            self._reset_prefix_cache,
            self._update_weight_version,
            self._resume,
        )
        return dict(zip(VLLM_DEV_PATHS, handlers, strict=True))

    async def _pause(self, receive: Receive, send: Send) -> None:
        if await request_body(receive, send) is None:
            return
        state = self.state
        if not state.paused:
            state.paused, state.resumed = True, trio.Event()
        await send_json(send, 200, {"status": "paused"})

    async def _resume(self, receive: Receive, send: Send) -> None:
        if await request_body(receive, send) is None:
            return
        self.state.paused = False
        self.state.resumed.set()
        await send_json(send, 200, {"status": "resumed"})

    async def _reset_prefix_cache(self, receive: Receive, send: Send) -> None:
        if await request_body(receive, send) is None:
            return
        await send_bytes(send, 200, b"")

    async def _collective_rpc(self, receive: Receive, send: Send) -> None:
        body = await request_body(receive, send)
        if body is None:
            return
        try:
            method, kwargs = parse_collective_rpc(body)
            if method != "reload_weights":
                raise BadRequest(f"no worker method {method!r} in this simulator")
            update = parse_weight_update(
                json.dumps({"weight_dir": kwargs.get("weights_path")}).encode()
            )
        except RequestRefused as exc:
            await send_error(send, exc.status, str(exc))
            return
        await trio.sleep(self.state.config.weight_update_s)
        self._loaded(update.weight_dir, update.version)
        await send_json(send, 200, {"results": [None]})

    async def _update_weight_version(self, receive: Receive, send: Send) -> None:
        body = await request_body(receive, send)
        if body is None:
            return
        try:
            new_version = parse_new_version(body)
        except RequestRefused as exc:
            await send_error(send, exc.status, str(exc))
            return
        await send_json(send, 200, {"success": True, "new_version": new_version})

    def _loaded(self, weight_dir: str, version: int | None) -> None:
        state = self.state
        state.weight_dir = weight_dir
        if version is not None:
            state.version = version
        log.info("weights updated", url=state.url, weight_dir=weight_dir, version=version)

    async def _health(self, send: Send) -> None:
        await send_json(send, 200, self.state.health())

    async def _update_weights(self, receive: Receive, send: Send) -> None:
        body = await request_body(receive, send)
        if body is None:
            return
        if self.state.config.reply_form == "upstream":
            # vLLM's own /update_weights takes a weight-transfer engine's update_info.
            await send_error(send, 400, "Missing 'update_info' in request body")
            return
        try:
            update = parse_weight_update(body)
        except RequestRefused as exc:
            await send_error(send, exc.status, str(exc))
            return
        await trio.sleep(self.state.config.weight_update_s)
        self._loaded(update.weight_dir, update.version)
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
        if config.ignores_n:
            request = attrs.evolve(request, n=1)
        if config.max_num_seqs and request.n > config.max_num_seqs:
            message = (
                "sampling_params.n must be at most the server's max_num_seqs "
                f"({config.max_num_seqs}), got {request.n}."
            )
            return 400, _encode(error_body(400, message))
        if request.payload_dir is not None:
            state.payload_requests += 1
        # A form without a by-handle mode (upstream vLLM) ignores payload_dir: inline.
        by_handle = state.form.by_handle
        payload_dir = request.payload_dir if by_handle is not None else None
        draw = draw_fault(state.fault_rng, config.faults, by_handle=payload_dir is not None)
        if draw.fault is Fault.HTTP_500:
            state.faults_served[Fault.HTTP_500.value] += 1
            message = "simulated internal server error (injected fault)"
            return 500, _encode(error_body(500, message))
        if draw.fault is Fault.HANG:
            state.faults_served[Fault.HANG.value] += 1
            await wait_for_disconnect(receive)
            return None, b""

        while state.paused:
            await state.resumed.wait()
        async with state.sequences.held(request.n):
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

        if by_handle is None or payload_dir is None:
            choices = await trio.to_thread.run_sync(
                _inline_choices,
                state.form,
                config.capture_sampling_mask,
                request,
                generations,
                limiter=state.compute_limiter,
            )
        else:
            choices = [
                await self._by_handle_choice(
                    by_handle, request, payload_dir, index, generation, draw.fault, draw.variant
                )
                for index, generation in enumerate(generations)
            ]
        prompt_len = len(request.token_ids)
        response = render_response(
            request.request_id,
            choices,
            prompt_len,
            kv_transfer_params=kv_transfer_params,
            model=config.served_model_name,
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
        form: ByHandleForm,
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
                form.payload_routing(generation.routed_experts),
                generation.routing_start,
            )
        if config.capture_sampling_mask:
            arrays["sampling_mask"] = (completion.sampling_mask, len(request.token_ids))
        choice = functools.partial(form.choice, index, completion, logprobs=request.logprobs)
        if not arrays:
            return choice(payload=[])
        # Faults hit the first choice only: a request with several choices then has a
        # poisoned rollout next to healthy ones, the case the orchestrator must keep apart.
        if fault is Fault.PAYLOAD_ERROR and index == 0:
            state.faults_served[Fault.PAYLOAD_ERROR.value] += 1
            return choice(
                payload=None, payload_error="simulated payload write failure (injected fault)"
            )
        try:
            segments = await write_payload(
                payload_dir, arrays, fsync=config.fsync, limiter=state.write_limiter
            )
        except (OSError, ValueError) as exc:
            log.warning("payload write failed", request_id=request.request_id, error=str(exc))
            return choice(payload=None, payload_error=f"{type(exc).__name__}: {exc}")
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
        await serve_pd_deployment(config, task_status=task_status)
        return
    state = _ServerState.fresh(config)
    async with trio.open_nursery() as nursery:
        address = await nursery.start(
            functools.partial(serve_asgi, _InferenceApp(state), host=config.host, port=config.port)
        )
        url = state.url = address.url
        log.info(
            "inference server listening",
            url=url,
            role=config.role,
            served_model_name=config.served_model_name,
            reply_form=config.reply_form,
            model=attrs.asdict(config.model),
        )
        task_status.started(url)


async def serve_pd_deployment(
    config: SimInferenceConfig, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED
) -> None:
    """A prefill server, a decode server (free loopback ports, `config`'s other settings,
    faults drawn from seeds `2 * fault_seed` and `2 * fault_seed + 1`) and the router in
    front of them on `config.host:config.port`, until cancelled. Reports the router's
    URL. Raises `OSError` when an address cannot be bound."""
    side = attrs.evolve(config, disaggregated=False, port=0, api_key="")
    prefill = attrs.evolve(side, role="prefill", fault_seed=2 * config.fault_seed)
    decode = attrs.evolve(side, role="decode", fault_seed=2 * config.fault_seed + 1)
    async with trio.open_nursery() as nursery:
        prefill_url = await nursery.start(serve_inference, prefill)
        decode_url = await nursery.start(serve_inference, decode)
        router = PDRouterConfig(
            prefill_url, decode_url, host=config.host, port=config.port, api_key=config.api_key
        )
        url = await nursery.start(serve_pd_router, router)
        log.info("P/D deployment listening", url=url, prefill=prefill_url, decode=decode_url)
        task_status.started(url)

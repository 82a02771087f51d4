"""`orchestrator sim-inference`: run one simulated inference server until SIGINT/SIGTERM.

It speaks vLLM's tokens-in/tokens-out generate API, answering in prime-rl's form (the
default) or upstream vLLM's (`--reply-form upstream`); see orchestrator.sim.inference
and, for the forms, orchestrator.sim.reply_forms.
With `--disaggregated` it serves a disaggregated prefill/decode deployment instead (a
router in front of a prefill and a decode server, orchestrator.sim.pd_router), and the
URL it prints is the router's.
When the server is ready it prints one line, `listening on http://HOST:PORT`, on stdout
(flushed), so a parent process can wait for it and learn the port chosen for `--port 0`.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import TYPE_CHECKING

from orchestrator.errors import UserError
from orchestrator.reply_form_names import DEFAULT_REPLY_FORM, REPLY_FORM_NAMES

if TYPE_CHECKING:
    from orchestrator.sim import SimInferenceConfig

HELP = "run one simulated inference server (the local fleet's unit)"

_FAULT_FLAGS = ("http_500", "hang", "malformed", "bad_segment", "payload_error")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the server's options to `parser`."""
    listen = parser.add_argument_group("listening")
    listen.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    listen.add_argument(
        "--port", type=int, default=0, help="port to bind; 0 picks a free one (default)"
    )
    model = parser.add_argument_group("model shape")
    model.add_argument("--layers", type=int, default=48, help="MoE layers (default %(default)s)")
    model.add_argument(
        "--top-k", type=int, default=8, help="experts per token (default %(default)s)"
    )
    model.add_argument(
        "--num-experts", type=int, default=128, help="experts per layer (default %(default)s)"
    )
    model.add_argument("--vocab-size", type=int, default=32000, help="(default %(default)s)")
    model.add_argument(
        "--eos-token-id",
        type=int,
        default=2,
        help="the token a natural stop ends with: the tokenizer's eos (default %(default)s)",
    )
    model.add_argument("--model-seed", type=int, default=0, help="(default %(default)s)")
    model.add_argument(
        "--served-model-name",
        default="sim-moe",
        help="the name a request's `model` must match, else 404 (default %(default)s)",
    )
    model.add_argument(
        "--max-model-len",
        type=int,
        default=65536,
        help="longest prompt + max_tokens; an absent max_tokens fills it (default %(default)s)",
    )
    replies = parser.add_argument_group("replies")
    replies.add_argument(
        "--reply-form",
        choices=REPLY_FORM_NAMES,
        default=DEFAULT_REPLY_FORM,
        help="answer as prime-rl's vLLM extension (packed inline or by handle) or as "
        "upstream vLLM (.npy routing, mask lists, never by handle) (default %(default)s)",
    )
    replies.add_argument(
        "--no-routed-experts",
        dest="capture_routed_experts",
        action="store_false",
        help="do not capture routing: replies carry routed_experts null",
    )
    replies.add_argument(
        "--no-sampling-mask",
        dest="capture_sampling_mask",
        action="store_false",
        help="do not capture sampling masks: replies carry sampling_mask null",
    )
    pd = parser.add_argument_group("disaggregated prefill/decode")
    pd.add_argument(
        "--disaggregated",
        action="store_true",
        help="serve a P/D deployment: a router on --host/--port in front of a prefill and "
        "a decode server on free loopback ports, both with these options",
    )
    pd.add_argument(
        "--role",
        choices=("aggregated", "prefill", "decode"),
        default="aggregated",
        help="serve one side of a P/D deployment instead of a whole server (default %(default)s)",
    )
    replies.add_argument(
        "--payload-digests",
        action="store_true",
        help="by handle, add each segment's blake2b digest (this project's extension)",
    )
    replies.add_argument(
        "--ignore-n",
        action="store_true",
        help="answer one choice whatever a request's n asks for, as a proxy that drops n",
    )
    timing = parser.add_argument_group("latency")
    timing.add_argument(
        "--time-per-token-s", type=float, default=0.0, help="seconds per decoded token"
    )
    timing.add_argument("--request-overhead-s", type=float, default=0.0, help="fixed per request")
    timing.add_argument("--weight-update-s", type=float, default=0.0, help="per /update_weights")
    timing.add_argument(
        "--max-num-seqs",
        type=int,
        default=0,
        help="requests generated at once, the rest queue (vLLM's setting; 0: no bound)",
    )
    faults = parser.add_argument_group("fault injection (rates in [0, 1])")
    for name in _FAULT_FLAGS:
        faults.add_argument(f"--{name.replace('_', '-')}-rate", type=_rate, default=0.0)
    faults.add_argument("--fault-seed", type=int, default=0, help="seed of the fault draws")
    parser.add_argument(
        "--fsync", action="store_true", help="fsync payload files before closing them"
    )
    parser.add_argument("--log-json", action="store_true", help="JSON log lines on stderr")


def _rate(text: str) -> float:
    """A probability from the command line; argparse reports the error with the option."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a rate must be in [0, 1], got {text}")
    return value


def _config(args: argparse.Namespace) -> SimInferenceConfig:
    """The server config from parsed arguments; `UserError` names a value out of range."""
    from orchestrator.sim import FaultRates, SimInferenceConfig, SimModel

    try:
        return SimInferenceConfig(
            model=SimModel(
                layers=args.layers,
                top_k=args.top_k,
                num_experts=args.num_experts,
                vocab_size=args.vocab_size,
                eos_token_id=args.eos_token_id,
                seed=args.model_seed,
            ),
            served_model_name=args.served_model_name,
            host=args.host,
            port=args.port,
            reply_form=args.reply_form,
            capture_routed_experts=args.capture_routed_experts,
            capture_sampling_mask=args.capture_sampling_mask,
            payload_digests=args.payload_digests,
            time_per_token_s=args.time_per_token_s,
            request_overhead_s=args.request_overhead_s,
            weight_update_s=args.weight_update_s,
            faults=FaultRates(**{name: getattr(args, f"{name}_rate") for name in _FAULT_FLAGS}),
            fault_seed=args.fault_seed,
            fsync=args.fsync,
            max_model_len=args.max_model_len,
            role=args.role,
            disaggregated=args.disaggregated,
            max_num_seqs=args.max_num_seqs,
            ignores_n=args.ignore_n,
        )
    except ValueError as exc:
        # attrs validators name the field, which is the option with `_` for `-`.
        raise UserError(f"bad option: {exc}") from None


def run(args: argparse.Namespace) -> int:
    """Serve until SIGINT or SIGTERM, then return 0. Raises `UserError` for bad options."""
    import trio

    from orchestrator.logs import configure_logging
    from orchestrator.sim import serve_inference

    config = _config(args)
    configure_logging(json_lines=True if args.log_json else None)

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                url = await nursery.start(serve_inference, config)
                sys.stdout.write(f"listening on {url}\n")
                sys.stdout.flush()
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(main)
    except (OSError, BaseExceptionGroup) as exc:
        bind_error = _only_os_error(exc)
        if bind_error is None:
            raise
        raise UserError(f"cannot serve on {args.host}:{args.port}: {bind_error}") from None
    return 0


def _only_os_error(exc: BaseException) -> OSError | None:
    """The OSError `exc` is or wraps (through nested groups) alone, else None."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, OSError) else None

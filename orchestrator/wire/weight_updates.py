"""How a running inference server is told to load a new policy version: the requests of
each `[inference] weight_update` protocol, as data (the daemon's client sends them).

- `"prime-rl"`: prime-rl's server extension, one `POST /update_weights {"weight_dir"}`.
- `"vllm"`: upstream vLLM's dev-mode endpoints (`VLLM_SERVER_DEV_MODE=1`), as its RL
  examples drive a server loading weights from disk: `/pause?mode=keep` (requests in
  flight are frozen where they are, not aborted, and go on under the new weights, as
  prime-rl's in-flight updates do), `/collective_rpc` running every worker's
  `reload_weights(weights_path=<dir>)` (a full checkpoint in the model's own layout),
  `/reset_prefix_cache` (cached prefixes were computed by the old weights),
  `/update_weight_version {"new_version"}`, then `/resume`, which is sent even when a
  step before it failed, so that a failed update never leaves a server paused.
- `"none"`: nothing; the trainer pushes weights itself (over NCCL, say) and the daemon
  only follows the published versions.

Pure: no I/O. Confirmed against vLLM 0.30.0's `entrypoints/serve/dev` routers and
`gpu_model_runner.reload_weights` (docs/protocol.md § Weight updates).

`moe_reload_refusal` decides whether a run may use `"vllm"` at all: the vLLM releases in
`MOE_RELOAD_BROKEN` reload a mixture-of-experts model without its expert weights, so
such a run would generate with weights that are not the trainer's (docs/design.md §13).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import attrs

WeightUpdate = Literal["prime-rl", "vllm", "none"]
#: The protocols, by their `[inference] weight_update` names.
WEIGHT_UPDATES: tuple[WeightUpdate, ...] = ("prime-rl", "vllm", "none")

#: prime-rl's extension: load a published policy, `{"weight_dir": ...}`.
UPDATE_WEIGHTS_PATH = "/update_weights"
#: Upstream vLLM's dev-mode endpoints that the "vllm" protocol uses (paths, no query).
VLLM_DEV_PATHS = (
    "/pause",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/update_weight_version",
    "/resume",
)


#: The endpoint where vLLM (and the local fleet) names its release: `{"version": "0.30.0"}`.
VERSION_PATH = "/version"

#: vLLM releases whose `reload_weights` does not load a mixture-of-experts model's expert
#: weights correctly: it logs `Following weights were not loaded from checkpoint:
#: {...w13_weight, ...w2_weight}`, and on the CPU copies the new experts into the
#: kernel's prepacked storage unpacked (docs/design.md §13), so every rollout after the
#: first update comes from weights that are not the trainer's. Dense models
#: reload correctly. A `"vllm"` run of a MoE model against one of these is refused at
#: start (`moe_reload_refusal`). Matched on the public part of the version, so a local
#: build label (`0.30.0+cu129`) counts as its release.
MOE_RELOAD_BROKEN: tuple[str, ...] = ("0.30.0",)


@attrs.frozen
class ControlCall:
    """One `POST` of a weight update: `path` (with its query) and the JSON `body` (None:
    no body)."""

    path: str
    body: Mapping[str, Any] | None = None

    @property
    def name(self) -> str:
        """The endpoint's name, for messages: `collective_rpc`."""
        return self.path.lstrip("/").split("?", 1)[0]


@attrs.frozen
class WeightUpdatePlan:
    """The calls of `protocol` that load one version, in order (each must answer 200),
    and those sent afterwards whatever happened (`finally`)."""

    protocol: WeightUpdate
    calls: tuple[ControlCall, ...] = ()
    finally_: tuple[ControlCall, ...] = ()


def weight_update_plan(protocol: WeightUpdate, weight_dir: Path, version: int) -> WeightUpdatePlan:
    """What tells one server running `protocol` to load `version` from `weight_dir`."""
    if protocol == "prime-rl":
        return WeightUpdatePlan(
            protocol, (ControlCall(UPDATE_WEIGHTS_PATH, {"weight_dir": str(weight_dir)}),)
        )
    if protocol == "vllm":
        pause, rpc, reset, version_path, resume = VLLM_DEV_PATHS
        return WeightUpdatePlan(
            protocol,
            (
                ControlCall(f"{pause}?mode=keep"),
                ControlCall(
                    rpc,
                    # vLLM passes only string arguments through this endpoint.
                    {"method": "reload_weights", "kwargs": {"weights_path": str(weight_dir)}},
                ),
                ControlCall(reset),
                ControlCall(version_path, {"new_version": str(version)}),
            ),
            finally_=(ControlCall(resume),),
        )
    if protocol == "none":
        return WeightUpdatePlan(protocol)
    raise ValueError(f"unknown weight update protocol {protocol!r}")


def refusal_hint(protocol: WeightUpdate, call: ControlCall, status: int) -> str | None:
    """What a server's refusal of a weight update most likely means, for the log line:
    the protocol does not match the server (the first policy update of a run against
    upstream vLLM was refused this way), or vLLM's dev endpoints are off."""
    if protocol == "prime-rl" and call.path == UPDATE_WEIGHTS_PATH and status in (400, 404, 422):
        return (
            "the server does not speak prime-rl's /update_weights: for upstream vLLM set "
            '[inference] weight_update = "vllm" (and VLLM_SERVER_DEV_MODE=1 on the server), '
            'or "none" when the trainer pushes weights itself'
        )
    if protocol == "vllm" and status == 404:
        return (
            f"vLLM answers /{call.name} only in its dev mode: start the server with "
            "VLLM_SERVER_DEV_MODE=1"
        )
    return None


def moe_reload_refusal(protocol: WeightUpdate, versions: Iterable[str], *, moe: bool) -> str | None:
    """Why a run with `protocol` may not start against servers reporting `versions`
    (their `GET /version`) on a model that is (`moe`) a mixture of experts: one line
    naming the fix, or None when nothing is wrong (another protocol, a dense model, or
    no version in `MOE_RELOAD_BROKEN`)."""
    if protocol != "vllm" or not moe:
        return None
    broken = sorted({v for v in versions if v.strip().split("+", 1)[0] in MOE_RELOAD_BROKEN})
    if not broken:
        return None
    return (
        f"vLLM {', '.join(broken)} does not reload a mixture-of-experts model's expert "
        'weights (weight_update = "vllm" would generate with weights that are not the '
        "trainer's): serve the model with `orchestrator-vllm serve` and set [inference] "
        'weight_update = "prime-rl", or set weight_update = "none" with a trainer that '
        "pushes weights itself"
    )

"""The generate reply caps: the pure derivation, and how the config resolves and checks them."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from orchestrator.cli import main
from orchestrator.config import (
    BatchConfig,
    Config,
    ConfigError,
    InferenceConfig,
    PayloadConfig,
    PayloadMode,
    SimConfig,
    load_config,
)
from orchestrator.config.reply_limits import (
    GIB,
    INLINE_REPLY_BYTES,
    MIB,
    ModelShape,
    derived_max_buffered_reply_bytes,
    derived_max_reply_bytes,
)

QWEN3_30B = ModelShape(layers=48, top_k=8)
TOKEN = 256  # JSON bytes counted per completion token
BOTH = ("routed_experts", "sampling_mask")


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Relative run directories resolve against the CWD, and HOME is refused as a root.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))


def derive(
    *,
    by_handle: bool = False,
    fields: tuple[str, ...] = BOTH,
    max_tokens: int = 2048,
    max_context_tokens: int = 16384,
    model: ModelShape | None = QWEN3_30B,
    choices: int = 1,
) -> int:
    return derived_max_reply_bytes(
        by_handle=by_handle,
        fields=fields,
        max_tokens=max_tokens,
        max_context_tokens=max_context_tokens,
        model=model,
        choices=choices,
    )


def test_by_handle_the_cap_is_tokens_and_logprobs_plus_a_mebibyte() -> None:
    assert derive(by_handle=True) == TOKEN * 2048 + MIB
    assert derive(by_handle=True, max_tokens=1) == TOKEN + MIB
    # The prompt bound and the model do not matter: no array travels in the reply.
    assert derive(by_handle=True, max_context_tokens=1 << 20, model=None) == TOKEN * 2048 + MIB
    # Nor inline when no payload field is asked for.
    assert derive(fields=()) == TOKEN * 2048 + MIB


def test_by_handle_covers_upstream_logprob_objects() -> None:
    entry = {"token": "token_id:31999", "logprob": -0.5821476803664449, "bytes": None}
    one = json.dumps({**entry, "top_logprobs": [entry]}) + ", 31999, "
    assert derive(by_handle=True, max_tokens=2048) > 2048 * len(one)


def test_inline_with_a_known_model_counts_the_widest_arrays() -> None:
    tokens = TOKEN * 2048 + MIB
    routing = 4 * -(-((16384 + 2048) * 48 * 8 * 4) // 3)  # int32 ids, base64
    mask = 2048 * 64 * 8  # JSON lists
    assert derive() == tokens + routing + mask
    assert derive(fields=("routed_experts",)) == tokens + routing
    assert derive(fields=("sampling_mask",)) == tokens + mask


def test_inline_covers_what_a_real_reply_of_the_bounds_holds() -> None:
    # A reply at the bounds: every position routed, every mask row 50 wide (top_k 50).
    positions, completion = 16384 + 2048, 2048
    arrays = positions * 48 * 8 + completion * 50 * 4
    json_tokens = completion * len("123456, -0.5821476803664449, ")
    assert derive() > 2 * (json_tokens + arrays * 4 // 3)
    # Upstream vLLM: int32 ids in a base64 .npy, masks as JSON lists of 64 five-digit ids.
    npy = positions * 48 * 8 * 4 * 4 // 3
    lists = completion * len(json.dumps([31999] * 64))
    assert derive() > npy + lists


def test_inline_without_a_model_shape_is_the_fixed_default() -> None:
    assert derive(model=None) == INLINE_REPLY_BYTES == 256 * MIB
    assert derive(model=None, max_tokens=8 << 20) == TOKEN * (8 << 20) + MIB


@pytest.mark.parametrize(
    ("cap", "inflight", "expected"),
    [
        (MIB, 64, 64 * MIB),  # every request at the cap: the bound never binds
        (256 * MIB, 64, GIB),  # capped at 1 GiB
        (2 * GIB, 4, 2 * GIB),  # never below one reply at the cap
        (MIB, 1, MIB),
    ],
)
def test_the_buffered_bound(cap: int, inflight: int, expected: int) -> None:
    got = derived_max_buffered_reply_bytes(max_reply_bytes=cap, max_inflight=inflight)
    assert got == expected


def test_a_reply_of_a_groups_choices_holds_them_all() -> None:
    one = derive(by_handle=True)
    assert derive(by_handle=True, choices=8) == 8 * (one - MIB) + MIB
    inline = derive()
    assert derive(choices=4) == 4 * (inline - MIB) + MIB
    assert derive(model=None, choices=4) == 4 * INLINE_REPLY_BYTES
    # 30 rollouts in flight in groups of 8: at most 4 replies.
    got = derived_max_buffered_reply_bytes(max_reply_bytes=MIB, max_inflight=30, choices=8)
    assert got == 4 * MIB


# --- the config -----------------------------------------------------------------------


def make(
    *,
    mode: PayloadMode = "inline",
    local_servers: int = 0,
    max_reply_bytes: int = 0,
    max_buffered_reply_bytes: int = 0,
    group_request: bool = False,
) -> Config:
    return Config(
        run_dir=Path("/srv/run"),
        batch=BatchConfig(max_seq_len=4096, group_size=4),
        payload=PayloadConfig(mode=mode),
        inference=InferenceConfig(
            urls=() if local_servers else ("http://gpu-a:8000",),
            max_inflight=32,
            max_reply_bytes=max_reply_bytes,
            max_buffered_reply_bytes=max_buffered_reply_bytes,
            group_request=group_request,
        ),
        sim=SimConfig(
            inference_servers=local_servers,
            layers=4,
            top_k=2,
            num_experts=300,
            prompt_len_max=512,
            max_tokens=256,
            max_turns=3,
        ),
    )


def test_the_config_derives_the_caps_from_its_own_keys() -> None:
    by_handle = make(mode="by_handle")
    assert by_handle.max_reply_bytes == TOKEN * 256 + MIB
    assert by_handle.max_buffered_reply_bytes == 32 * (TOKEN * 256 + MIB)
    # Real servers, inline: no model shape in the config.
    assert make().max_reply_bytes == 256 * MIB
    assert make().max_buffered_reply_bytes == GIB
    # The local fleet's shape; the prompt bound is max_seq_len (4096 > 512 + 3 * 256).
    local = make(local_servers=2)
    assert local.max_reply_bytes == derive(
        max_tokens=256,
        max_context_tokens=4096,
        model=ModelShape(layers=4, top_k=2),
    )
    # Real servers whose shape the config states.
    stated = attrs.evolve(make(), payload=PayloadConfig(mode="inline", layers=4, top_k=2))
    assert stated.max_reply_bytes == derive(
        max_tokens=256, max_context_tokens=4096, model=ModelShape(4, 2)
    )


def test_a_group_request_counts_the_groups_choices() -> None:
    grouped = make(mode="by_handle", group_request=True)
    assert grouped.group_choices == 4
    assert grouped.max_reply_bytes == 4 * TOKEN * 256 + MIB
    assert grouped.max_buffered_reply_bytes == 8 * (4 * TOKEN * 256 + MIB)
    # Behind a disaggregated router each rollout is a request of its own.
    pd = attrs.evolve(grouped, inference=attrs.evolve(grouped.inference, disaggregated=True))
    assert pd.group_choices == 1
    assert pd.max_reply_bytes == TOKEN * 256 + MIB


def test_the_prompt_bound_covers_every_turn_when_turns_outgrow_max_seq_len() -> None:
    config = Config(
        run_dir=Path("/srv/run"),
        batch=BatchConfig(max_seq_len=64),
        payload=PayloadConfig(mode="inline"),
        sim=SimConfig(inference_servers=1, prompt_len_max=512, max_tokens=256, max_turns=3),
    )
    expected = derive(
        max_tokens=256,
        max_context_tokens=512 + 3 * 256,
        model=ModelShape(48, 8),
        choices=config.batch.group_size,
    )
    assert config.max_reply_bytes == expected


def test_set_values_win() -> None:
    config = make(max_reply_bytes=5 * MIB, max_buffered_reply_bytes=50 * MIB)
    assert (config.max_reply_bytes, config.max_buffered_reply_bytes) == (5 * MIB, 50 * MIB)
    # The bound follows a set cap.
    assert make(max_reply_bytes=5 * MIB).max_buffered_reply_bytes == 32 * 5 * MIB


def test_a_bound_below_the_cap_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        'run_dir = "run"\n[inference]\nurls = ["http://a:1"]\n'
        "max_reply_bytes = 1000\nmax_buffered_reply_bytes = 999\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value) == (
        f"{path}: inference.max_buffered_reply_bytes = 999 must be at least the per-reply "
        "cap (1000 bytes): a reply at the cap could never be read"
    )
    with pytest.raises(ConfigError, match="max_reply_bytes"):
        load_config(path, ["inference.max_reply_bytes=-1"])
    assert load_config(path, ["inference.max_buffered_reply_bytes=1000"]).max_reply_bytes == 1000


def test_check_config_shows_the_caps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        'run_dir = "run"\n[inference]\nurls = ["http://a:1", "http://b:1"]\n', encoding="utf-8"
    )
    assert main(["check-config", str(path)]) == 0
    header = capsys.readouterr().out.split("\n\n", 1)[0]
    # A reply holds a group's 8 choices; 64 rollouts in flight are 8 such replies.
    cap = 8 * TOKEN * 256 + MIB
    assert f"#   reply cap:    {cap} bytes (derived)" in header
    assert f"#   reply budget: {8 * cap} bytes (derived)" in header

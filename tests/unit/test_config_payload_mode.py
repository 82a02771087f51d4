"""The resolved payload mode: the "auto" rule's truth table, and explicit modes."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from orchestrator.config import (
    Config,
    InferenceConfig,
    PayloadConfig,
    PayloadMode,
    SimConfig,
)

ONE_HOST = ("http://gpu-a:8000", "http://gpu-a:8001")
TWO_HOSTS = ("http://gpu-a:8000", "http://GPU-B:8000")


def make(
    *,
    mode: PayloadMode = "auto",
    fields: bool = True,
    urls: tuple[str, ...] = ONE_HOST,
    local_servers: int = 0,
    multi_node: bool = False,
    disaggregated: bool = False,
) -> Config:
    return Config(
        run_dir=Path("/srv/run"),
        payload=PayloadConfig(
            mode=mode, fields=("routed_experts", "sampling_mask") if fields else ()
        ),
        inference=InferenceConfig(
            urls=() if local_servers else urls,
            multi_node=multi_node,
            disaggregated=disaggregated,
        ),
        sim=SimConfig(inference_servers=local_servers),
    )


@pytest.mark.parametrize(
    ("fields", "many_hosts", "multi_node", "disaggregated"),
    list(itertools.product([False, True], repeat=4)),
)
def test_auto_truth_table(
    fields: bool, many_hosts: bool, multi_node: bool, disaggregated: bool
) -> None:
    config = make(
        fields=fields,
        urls=TWO_HOSTS if many_hosts else ONE_HOST,
        multi_node=multi_node,
        disaggregated=disaggregated,
    )
    # Disaggregated prefill/decode takes either mode: the router forwards both sides'
    # segments by handle, merges routing inline.
    expected = fields and (many_hosts or multi_node)
    assert config.by_handle is expected
    assert config.payload_mode_reason.startswith("auto: ")


def test_host_names_are_compared_without_case() -> None:
    config = make(urls=("http://gpu-a:8000", "http://GPU-A:8001"))
    assert config.inference_hosts == frozenset({"gpu-a"})
    assert config.by_handle is False


@pytest.mark.parametrize("local_servers", [1, 2, 8])
def test_local_servers_are_one_host(local_servers: int) -> None:
    config = make(local_servers=local_servers)
    assert config.inference_hosts == frozenset({"127.0.0.1"})
    assert config.by_handle is False
    assert make(local_servers=local_servers, multi_node=True).by_handle is True


@pytest.mark.parametrize(
    ("mode", "expected"),
    [("by_handle", True), ("inline", False)],
)
def test_explicit_modes_are_taken_as_given(mode: PayloadMode, expected: bool) -> None:
    for urls, fields in [(ONE_HOST, True), (TWO_HOSTS, True), (TWO_HOSTS, False)]:
        config = make(mode=mode, urls=urls, fields=fields, multi_node=True)
        assert config.by_handle is expected
        assert config.payload_mode_reason == f'set explicitly: payload.mode = "{mode}"'


def test_inline_with_disaggregated_is_allowed() -> None:
    assert make(mode="inline", disaggregated=True).by_handle is False


def test_by_handle_with_disaggregated_is_allowed() -> None:
    config = make(mode="by_handle", disaggregated=True)
    assert config.by_handle is True
    assert config.payload_mode_reason == 'set explicitly: payload.mode = "by_handle"'


def test_reasons_name_the_deciding_fact() -> None:
    assert make(fields=False, urls=TWO_HOSTS).payload_mode_reason == (
        "auto: no payload fields requested"
    )
    assert make(urls=TWO_HOSTS, disaggregated=True).payload_mode_reason == (
        "auto: 2 inference hosts share the payload root"
    )
    assert make(urls=TWO_HOSTS).payload_mode_reason == (
        "auto: 2 inference hosts share the payload root"
    )
    assert make(multi_node=True).payload_mode_reason == "auto: inference.multi_node = true"
    assert make().payload_mode_reason == "auto: one inference host and not multi_node"

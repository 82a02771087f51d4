"""The daemon against upstream vLLM (CPU build, `tests/vllm/requirements.txt`), serving a
tiny mixture-of-experts model made here: the reply form as captured, routing compared with
the router `transformers` computes from the same weights, runs end to end with real
tasks (the dense twin's versions reloaded through vLLM's dev endpoints; a MoE run that
would reload through them refused at start), and the findings of a first run against
upstream vLLM (all-zero routing accepted, a stall blamed on the wrong cause), each a
test. MoE weight loads through `orchestrator-vllm` are test_weight_loads.py."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import structlog.testing
import trio
from _vllm_kit import (
    Server,
    against_vllm,
    generate,
    key_file,
    reference,
    run_against,
    tiny_model,
    vllm_server,
)

from orchestrator.commands.launch import launch_run
from orchestrator.config import load_config
from orchestrator.core.turns import TurnOutput
from orchestrator.daemon import RunState
from orchestrator.daemon.inference.client import load_weights
from orchestrator.daemon.inference.http11 import HTTP11Client
from orchestrator.errors import UserError
from orchestrator.handoff import read_batch
from orchestrator.tasks.chat import ChatTokenizer
from orchestrator.wire import build_generate_request, parse_generate_response, weight_update_plan

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "configs" / "demo.toml"
GOLDEN = ROOT / "tests" / "conformance" / "golden"
#: Router logits closer than this between the k-th and the (k+1)-th expert are a near-tie:
#: the server's kernels (another summation order, fused ops) may pick either.
NEAR_TIE = 1e-3
#: The longest a brief run waits for what it looks for.
BRIEF_RUN_DEADLINE_S = 120.0


def greedy_body(prompt: list[int], max_tokens: int, *, routing: bool = True) -> dict:
    body = build_generate_request(
        request_id="t",
        token_ids=prompt,
        seed=0,
        payload_dir=None,
        routing_start=0 if routing else None,
        max_tokens=max_tokens,
    )
    body["sampling_params"]["temperature"] = 0.0
    return body


def inline_turn(content: bytes, prompt: list[int]) -> TurnOutput:
    """A reply with routing inline from position 0, parsed as the daemon parses it."""
    return parse_generate_response(
        content,
        prompt_len=len(prompt),
        routing_start=0,
        payload_dir=None,
        fields=("routed_experts",),
    )


def test_the_reply_has_the_captured_form(eager_server: Server, model: Path) -> None:
    golden = json.loads((GOLDEN / "vllm_0_30_0_generate.json").read_text())
    reply = generate(eager_server, golden["request"]).json()
    # The same keys at every level as the captured reply, the same routing encoding.
    captured = golden["reply"]
    assert reply.keys() == captured.keys()
    assert reply["request_id"].startswith("generate-tokens-")
    choice, captured_choice = reply["choices"][0], captured["choices"][0]
    assert choice.keys() == captured_choice.keys()
    assert (
        choice["logprobs"]["content"][0].keys() == captured_choice["logprobs"]["content"][0].keys()
    )
    prompt = golden["request"]["token_ids"]
    turn = parse_generate_response(
        json.dumps(reply).encode(),
        prompt_len=len(prompt),
        routing_start=0,
        payload_dir=None,
        fields=("routed_experts",),
    )
    assert turn.poisoned is None
    ids, start = turn.inline["routed_experts"]
    assert start == 0 and ids.shape == (len(prompt) + len(turn.completion_ids) - 1, 2, 2)


def test_routing_rows_are_the_routers_top_k(
    eager_server: Server, model: Path, figure: Callable[[str], None]
) -> None:
    tokenizer = ChatTokenizer.load(model)
    prompt = tokenizer.render_prompt([{"role": "user", "content": "What is 17 + 25?"}]).tolist()
    reply = generate(eager_server, greedy_body(prompt, 24))
    turn = inline_turn(reply.content, prompt)
    assert turn.poisoned is None
    served, _ = turn.inline["routed_experts"]
    tokens = prompt + turn.completion_ids.tolist()
    # transformers, same weights, same tokens: every position run forward.
    expected = reference(model, {"routing": tokens[:-1], "prompt": prompt, "max_tokens": 24})
    assert expected["completion"] == turn.completion_ids.tolist()
    want = np.asarray(expected["experts"])
    margins = np.asarray(expected["margins"])
    assert served.shape == want.shape
    same = np.sort(served, axis=-1) == np.sort(want, axis=-1)
    rows_equal = same.all(axis=-1)
    decisive = margins >= NEAR_TIE
    # Every decisive row agrees; near-ties may go either way.
    assert rows_equal[decisive].all(), np.argwhere(~rows_equal & decisive)[:5]
    assert decisive.mean() > 0.9
    figure(
        f"routing vs transformers: {int(rows_equal.sum())} of {rows_equal.size} rows equal, "
        f"{int((~decisive).sum())} near-ties (margin < {NEAR_TIE}), "
        f"{int((rows_equal | ~decisive).sum())} agree or tie"
    )


GAME = """
class Game:
    def prompt(self, index):
        return [{"role": "user", "content": f"Game {index}: guess a number."}], {"index": index}

    def step(self, messages, info):
        replies = sum(1 for m in messages if m["role"] == "assistant")
        return None if replies >= 3 else [{"role": "user", "content": "Wrong, again."}]

    def score(self, messages, info):
        return float(len(messages[-1]["content"]) % 2)


def make_game():
    return Game()
"""


async def test_multi_turn_episodes_replay_only_the_new_rows_and_match_the_router(
    eager_server: Server,
    model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    figure: Callable[[str], None],
) -> None:
    # Three turns a rollout, each later prompt bridged onto the sampled ids and asking for
    # routing from routed_experts_prompt_start only; the weights stay the base model's
    # (weight_update = "none"), so every shipped row can be checked against the router.
    (tmp_path / "games.py").write_text(GAME)
    monkeypatch.chdir(tmp_path)
    steps = 2
    overrides = against_vllm(tmp_path / "run", eager_server, model, f"max_steps={steps}")
    overrides += [
        'inference.weight_update="none"',
        'env=[{name = "game", factory = "games:make_game", max_turns = 3, max_tokens = 8}]',
    ]
    config = load_config(DEMO, overrides)
    with trio.fail_after(600):
        outcome = await launch_run(config)
    assert outcome.state.dispatch.failures["poisoned_payload"] == 0
    batch = read_batch(config.batches_dir / f"step_{steps:06d}")
    # A later turn: the loss mask rises from 0 to 1 more than once.
    multi_turn = [
        s for s in batch.samples if int(np.sum(np.diff(s.loss_mask.astype(int)) == 1)) >= 2
    ]
    assert multi_turn, "no sample had a later turn"
    sample = max(multi_turn, key=lambda s: s.length)
    tokens = sample.token_ids.tolist()
    expected = reference(model, {"routing": tokens[:-1]})
    want = np.sort(np.asarray(expected["experts"]), axis=-1)
    decisive = np.asarray(expected["margins"]) >= NEAR_TIE
    served = np.sort(np.asarray(sample.routed_experts[:-1]), axis=-1)
    rows_equal = (served == want).all(axis=-1)
    assert rows_equal[decisive].all(), np.argwhere(~rows_equal & decisive)[:5]
    equal, rows = int(rows_equal.sum()), rows_equal.size
    figure(f"multi-turn routing vs transformers: {equal} of {rows} rows equal")


async def test_a_moe_run_reloading_through_vllms_dev_endpoints_is_refused_at_start(
    eager_server: Server, model: Path, tmp_path: Path
) -> None:
    # vLLM 0.30.0's reload_weights leaves a MoE's experts unloaded (the strict xfail
    # below): a run that would train on such a server is refused before it starts, in one
    # line naming the fix. Its payload root is never wiped.
    payloads = tmp_path / "run" / "payloads"
    payloads.mkdir(parents=True)
    (payloads / "kept").write_text("x")
    config = load_config(
        DEMO,
        against_vllm(
            tmp_path / "run", eager_server, model, "max_steps=2", 'inference.weight_update="vllm"'
        ),
    )
    with pytest.raises(UserError) as refused:
        await launch_run(config)
    line = str(refused.value)
    assert "\n" not in line and "0.30.0" in line, line
    assert "orchestrator-vllm serve" in line and 'weight_update = "prime-rl"' in line, line
    assert (payloads / "kept").read_text() == "x"
    assert not config.batches_dir.exists() or not list(config.batches_dir.iterdir())


def greedy_versions(server: Server, checkpoints: list[Path]) -> list[int]:
    """Which of `checkpoints` the server answers a greedy request as (transformers')."""
    prompt = list(range(300, 316))
    served = generate(server, greedy_body(prompt, 12, routing=False)).json()
    tokens = served["choices"][0]["token_ids"]
    greedy = [
        reference(folder, {"prompt": prompt, "max_tokens": 12})["completion"]
        for folder in checkpoints
    ]
    # Each version answers differently, so the answer names one.
    assert len({tuple(g) for g in greedy}) == len(greedy)
    return [k for k, g in enumerate(greedy) if g == tokens]


#: The token the dense server is closed with (`vllm serve --api-key`).
API_KEY = "sk-tiny-dense-5e2b"


@pytest.fixture(scope="module")
def dense_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    model = tiny_model("dense")
    with vllm_server(
        model,
        tmp_path_factory.mktemp("dense"),
        "--enforce-eager",
        routing=False,
        api_key=API_KEY,
    ) as server:
        yield server


async def test_the_server_holds_each_version_the_run_applied(
    dense_server: Server, tmp_path: Path
) -> None:
    # The dense twin (no routing): vLLM 0.30.0 reloads it from disk correctly, so greedy
    # tokens tell the version it holds: the last one applied, as transformers generates
    # from that checkpoint, and no other. It is closed with --api-key: the run reads the
    # token from a file and sends it.
    model = tiny_model("dense")
    steps = 3
    config, outcome = await run_against(
        dense_server,
        model,
        tmp_path / "run",
        steps,
        "payload.fields=[]",
        'inference.weight_update="vllm"',
        key_file(dense_server, tmp_path),
    )
    assert outcome.state.dispatch.failures["unauthorized"] == 0
    assert API_KEY not in (config.state_dir / "progress.json").read_text()
    applied = outcome.state.versions.applied
    assert applied >= 2
    checkpoints = [model] + [config.weights_dir / f"step_{k:06d}" for k in range(1, applied + 1)]
    assert greedy_versions(dense_server, checkpoints) == [applied]


@pytest.mark.xfail(
    strict=True,
    reason="vLLM 0.30.0 (CPU) reload_weights does not reload fused MoE experts correctly: "
    "it logs their weights as not loaded, and even the base checkpoint reloaded gives other "
    "tokens (docs/protocol.md § Weight updates; orchestrator-vllm's /update_weights loads "
    "them, test_weight_loads.py); strict: an upgrade that fixes it fails here",
)
async def test_a_moe_server_reloads_its_own_checkpoint_unchanged(
    eager_server: Server, model: Path, tmp_path: Path
) -> None:
    async with HTTP11Client() as client:
        await load_weights(client, eager_server.url, weight_update_plan("vllm", model, 0))
    assert greedy_versions(eager_server, [model]) == [0]


async def brief_run(
    server: Server,
    model: Path,
    run_dir: Path,
    seen: Callable[[RunState], bool],
    *more: str,
) -> RunState:
    """A run against `server`, stopped once `seen(state)` holds (at most RUN_DEADLINE_S);
    its state."""
    config = load_config(DEMO, against_vllm(run_dir, server, model, "max_steps=3", *more))
    async with trio.open_nursery() as nursery:
        state = await nursery.start(launch_run, config)
        with trio.move_on_after(BRIEF_RUN_DEADLINE_S):
            # The run's state has no event for what a test looks for: it is polled.
            while not seen(state):  # noqa: ASYNC110
                await trio.sleep(0.2)
        nursery.cancel_scope.cancel()
    return state


def failed(kind: str) -> Callable[[RunState], bool]:
    return lambda state: state.dispatch.failures[kind] > 0


async def test_routing_of_a_compiled_cpu_server_is_refused_with_the_cause(
    model: Path, tmp_path: Path
) -> None:
    # The second finding: compiled (no --enforce-eager), vLLM 0.30.0's CPU build answers
    # routing of the right shape in which every id is 0; the daemon trained on it.
    with vllm_server(model, tmp_path / "vllm") as compiled:
        state = await brief_run(compiled, model, tmp_path / "run", failed("poisoned_payload"))
    assert state.shipping.next_step == 1
    assert state.dispatch.failures["poisoned_payload"] > 0
    ((text, _),) = state.dispatch.rejections.most_common("poisoned_payload", 1)
    assert text.startswith("all-zero routing") and "--enforce-eager" in text, text


async def test_a_server_without_routing_capture_stalls_with_the_right_hint(
    model: Path, dense_server: Server, tmp_path: Path
) -> None:
    # The third finding: without routing capture every reply lacks routed_experts, and
    # the stall warning blamed samples longer than batch.max_seq_len. The server here is
    # the dense twin's (started without --enable-return-routed-experts, as a MoE server
    # forgotten without it): the run is the MoE's, and asks for routing.
    # The warning repeats every stall_warning_s; its hint comes once rollouts were
    # discarded (a first warning can come before any group ended: the CPU server is slow,
    # and the demo's eval of v0 shares it).
    def stalled(_: RunState) -> bool:
        return any(e["event"] == "no batch shipped" and "hint" in e for e in logs)

    with structlog.testing.capture_logs() as logs:
        await brief_run(
            dense_server,
            model,
            tmp_path / "run",
            stalled,
            "progress.stall_warning_s=3",
            key_file(dense_server, tmp_path),
        )
    stalls = [e for e in logs if e["event"] == "no batch shipped"]
    hints = [e["hint"] for e in stalls if "hint" in e]
    assert hints, (stalls, [e["event"] for e in logs][-20:])
    hint = hints[-1]
    assert "max_seq_len" not in hint
    assert "payloads were refused" in hint and "no routed_experts" in hint


async def test_a_closed_server_names_a_missing_token(dense_server: Server, tmp_path: Path) -> None:
    # vllm serve --api-key answers the generate endpoint without the token with 401; the
    # daemon counts that as "unauthorized" and says which keys set the token.
    refused = generate(dense_server, greedy_body([300, 301], 2, routing=False), headers={})
    assert (refused.status_code, refused.json()) == (401, {"error": "Unauthorized"})
    state = await brief_run(
        dense_server,
        tiny_model("dense"),
        tmp_path / "run",
        failed("unauthorized"),
        "payload.fields=[]",
    )
    assert state.dispatch.failures["unauthorized"] > 0
    ((text, _),) = state.dispatch.rejections.most_common("unauthorized", 1)
    assert text.startswith("the server wants a bearer token: set [inference] api_key_env"), text

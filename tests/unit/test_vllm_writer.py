"""The payload writer for upstream vLLM (`vllm-writer/`, the `orchestrator-vllm`
distribution) without vLLM: its middleware in front of an ASGI app that answers as vLLM
0.30.0 answered (the captured golden), real files in a real payload root. The reply it
produces is read by the daemon's own parser, as by handle, and the rows in the file equal
the inline rows; hostile directories are refused and nothing is written outside the root.
`tests/vllm` runs it in front of a real vLLM."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from orchestrator_vllm import cli
from orchestrator_vllm.files import lexical_problem, open_payload_dir
from orchestrator_vllm.middleware import PayloadWriter, WriterSettings
from orchestrator_vllm.payloads import ReplyProblem, choice_arrays, mask_array, narrowed
from payload_gc import PayloadRootFiles

from orchestrator.payload import read_rows
from orchestrator.wire import parse_generate_response

GOLDEN = Path(__file__).resolve().parents[1] / "conformance" / "golden"
CAPTURED = json.loads((GOLDEN / "vllm_0_30_0_generate.json").read_text())


def inline_rows(choice: dict[str, Any]) -> np.ndarray:
    rows: np.ndarray = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
    return rows


class FakeVLLM:
    """An ASGI app that answers every request with `reply` (status `status`) and keeps the
    bodies it was sent."""

    def __init__(self, reply: dict[str, Any], status: int = 200) -> None:
        self.reply = reply
        self.status = status
        self.bodies: list[bytes] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        data = json.dumps(self.reply).encode()
        await send(
            {
                "type": "http.response.start",
                "status": self.status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                    (b"x-request-id", b"r"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})


def call(app: Any, body: bytes, path: str = "/inference/v1/generate") -> tuple[int, dict, bytes]:
    """One POST through `app` on asyncio; (status, headers, body)."""
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": path, "root_path": ""}
        await app(scope, receive, send)

    asyncio.run(run())
    start = sent[0]
    headers = dict(start["headers"])
    data = b"".join(m.get("body", b"") for m in sent[1:])
    assert int(headers[b"content-length"]) == len(data)
    return start["status"], headers, data


def request(payload_dir: object) -> dict[str, Any]:
    body = json.loads(json.dumps(CAPTURED["request"]))
    body["sampling_params"]["extra_args"] = {"payload_dir": payload_dir}
    return body


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "payloads"
    path.mkdir()
    return path


def writer(root: Path, reply: dict[str, Any] | None = None, status: int = 200):
    vllm = FakeVLLM(CAPTURED["reply"] if reply is None else reply, status)
    return vllm, PayloadWriter(vllm, WriterSettings(root=str(root), fsync=True))


def test_by_handle_the_file_holds_the_inline_rows_and_the_daemon_reads_it(root: Path) -> None:
    vllm, app = writer(root)
    payload_dir = root / "v3"
    body = request(str(payload_dir))
    status, _, data = call(app, json.dumps(body).encode())
    assert status == 200
    reply = json.loads(data)
    choice = reply["choices"][0]
    assert choice["routed_experts"] is None and choice["sampling_mask"] is None
    ((segment,),) = [choice["payload"]]
    name = Path(segment["file"]).name
    assert segment["file"] == str(payload_dir / name)
    assert sorted(os.listdir(payload_dir)) == [name]
    # Everything else of vLLM's reply is as vLLM sent it.
    original = CAPTURED["reply"]
    assert {k: v for k, v in reply.items() if k != "choices"} == {
        k: v for k, v in original.items() if k != "choices"
    }
    # The daemon's own parser takes it as a by-handle turn, and the rows on disk are the
    # inline ones, narrowed.
    prompt_len = len(body["token_ids"])
    turn = parse_generate_response(
        data,
        prompt_len=prompt_len,
        routing_start=0,
        payload_dir=payload_dir,
        fields=["routed_experts"],
    )
    assert turn.poisoned is None, turn.poisoned
    inline = inline_rows(original["choices"][0])
    assert (segment["pos"], segment["rows"], segment["dtype"]) == (0, len(inline), "uint8")
    assert segment["shape"] == list(inline.shape[1:])
    with PayloadRootFiles(root) as files:
        rows = read_rows(files.version(3), turn.segments["routed_experts"], 0, segment["rows"])
    assert np.array_equal(rows, inline)
    # vLLM was sent the request byte for byte.
    assert vllm.bodies == [json.dumps(body).encode()]


def test_requests_without_payload_dir_are_untouched(root: Path) -> None:
    vllm, app = writer(root)
    body = json.dumps(CAPTURED["request"]).encode()
    status, headers, data = call(app, body)
    assert status == 200 and json.loads(data) == CAPTURED["reply"]
    assert headers[b"x-request-id"] == b"r"
    assert vllm.bodies == [body]
    # Another path, and a body that is not JSON, reach vLLM as they came.
    assert call(app, b"{not json")[0] == 200
    assert vllm.bodies[-1] == b"{not json"
    call(app, body, path="/v1/completions")
    assert vllm.bodies[-1] == body
    assert list(root.iterdir()) == []


def test_a_refusal_of_vllm_goes_back_as_it_is(root: Path) -> None:
    refusal = {"error": {"message": "nope", "type": "BadRequestError", "param": None, "code": 400}}
    _, app = writer(root, refusal, status=400)
    status, _, data = call(app, json.dumps(request(str(root / "v0"))).encode())
    assert (status, json.loads(data)) == (400, refusal)
    assert list(root.iterdir()) == []


@pytest.mark.parametrize(
    ("payload_dir", "expected"),
    [
        ("v0", "is not an absolute path"),
        ("{root}/../elsewhere", "is not spelled plainly"),
        ("{root}/./v0", "is not spelled plainly"),
        ("{root}//v0", "is not spelled plainly"),
        ("{root}/v0/", "is not spelled plainly"),
        ("/tmp", "is outside the payload root"),
        ("{root}-sibling/v0", "is outside the payload root"),
        (7, "must be a non-empty string"),
        ("", "must be a non-empty string"),
    ],
)
def test_hostile_directories_are_refused_before_vllm_sees_them(
    root: Path, payload_dir: object, expected: str
) -> None:
    vllm, app = writer(root)
    spelled = payload_dir.format(root=root) if isinstance(payload_dir, str) else payload_dir
    status, _, data = call(app, json.dumps(request(spelled)).encode())
    assert status == 400
    error = json.loads(data)["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert expected in error["message"]
    assert vllm.bodies == []


def test_a_linked_directory_is_refused_and_nothing_is_written_through_it(
    root: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (root / "v1").symlink_to(outside)
    (root / "v2").write_text("a file, not a directory")
    _, app = writer(root)
    for name in ("v1", "v2", "v1/deeper", "missing/v0"):
        status, _, data = call(app, json.dumps(request(str(root / name))).encode())
        assert status == 400, name
        message = json.loads(data)["error"]["message"]
        assert "is a symbolic link or not a directory" in message or "does not exist" in message
    assert list(outside.iterdir()) == []
    assert not (root / "missing").exists()


def test_without_a_payload_root_every_payload_dir_is_refused() -> None:
    assert "start orchestrator-vllm with --payload-root" in (lexical_problem("/x", None) or "")


def test_the_last_directory_is_created_once(root: Path) -> None:
    fd, created = open_payload_dir(str(root), str(root / "v9"))
    os.close(fd)
    fd, again = open_payload_dir(str(root), str(root / "v9"))
    os.close(fd)
    assert (created, again) == (True, False)
    fd, _ = open_payload_dir(str(root), str(root))
    os.close(fd)


def test_a_file_that_cannot_be_written_poisons_only_its_choice(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: object, **kwargs: object) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("orchestrator_vllm.middleware.write_file", full)
    _, app = writer(root)
    status, _, data = call(app, json.dumps(request(str(root / "v0"))).encode())
    choice = json.loads(data)["choices"][0]
    assert status == 200
    assert choice["payload"] is None
    assert choice["payload_error"] == "OSError: [Errno 28] No space left on device"
    assert choice["token_ids"] == CAPTURED["reply"]["choices"][0]["token_ids"]


def test_masks_and_dtypes() -> None:
    mask = mask_array([[5, 7], [], [9]], prompt_len=4)
    assert mask is not None and mask.pos == 4
    assert mask.array.tolist() == [[5, 7], [-1, -1], [9, -1]]
    assert mask_array([[], []], prompt_len=4) is None
    assert narrowed(np.array([[[0, 255]]])).dtype.name == "uint8"
    assert narrowed(np.array([[[0, 256]]])).dtype.name == "uint16"
    assert narrowed(np.array([[[-1, 3]]])).dtype.name == "int32"
    with pytest.raises(ReplyProblem, match=r"not a base64 \.npy"):
        choice_arrays({"token_ids": [1], "routed_experts": "!!"}, prompt_len=2)
    with pytest.raises(ReplyProblem, match="more than the"):
        rows = np.zeros((9, 2, 2), dtype=np.uint8)
        encoded = io.BytesIO()
        np.save(encoded, rows)
        choice_arrays(
            {"token_ids": [1], "routed_experts": base64.b64encode(encoded.getvalue()).decode()},
            prompt_len=2,
        )


def test_the_command_refuses_a_vllm_it_does_not_know(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    for name in ("ORCH_VLLM_PAYLOAD_ROOT", "ORCH_VLLM_PAYLOAD_FSYNC", "ORCH_VLLM_WRITER_THREADS"):
        monkeypatch.delenv(name, raising=False)  # restored after the test
    monkeypatch.setattr(cli, "installed_vllm", lambda: ("vllm", "0.31.0"))
    assert cli.main(["serve", "model"]) == 2
    assert capsys.readouterr().err == (
        "orchestrator-vllm: error: vllm 0.31.0 is not a vLLM version this writer was tested "
        "with (0.30.0): install one of those, or an orchestrator-vllm that knows 0.31.0\n"
    )
    monkeypatch.setattr(cli, "installed_vllm", lambda: ("vllm", "0.30.0"))
    assert cli.main(["serve", "model", "--payload-root", "relative"]) == 2
    assert "is not an absolute path" in capsys.readouterr().err
    argv = cli.prepare(["serve", "model", "--payload-root", str(tmp_path), "--port=1", "--pay"])
    # The writer's flags are its own; vLLM's (and any prefix of one) go through.
    assert argv == [
        "vllm",
        "serve",
        "model",
        "--port=1",
        "--pay",
        "--middleware",
        cli.MIDDLEWARE,
        "--worker-extension-cls",
        cli.WORKER_EXTENSION,
    ]
    assert os.environ["ORCH_VLLM_PAYLOAD_ROOT"] == str(tmp_path)
    # Weight loads need the writer's own worker extension.
    assert cli.main(["serve", "model", "--worker-extension-cls=mine.Worker"]) == 2
    assert "--worker-extension-cls is taken" in capsys.readouterr().err


@pytest.mark.parametrize("reply", [{"unexpected": 1}, {"choices": "no list"}, {"choices": [7]}])
def test_a_reply_the_writer_does_not_know_goes_back_as_vllm_sent_it(
    root: Path, reply: dict[str, Any]
) -> None:
    _, app = writer(root, reply)
    status, _, data = call(app, json.dumps(request(str(root / "v0"))).encode())
    assert (status, json.loads(data)) == (200, reply)
    assert list(root.iterdir()) == []


class RecordingEngine:
    """The engine calls `/update_weights` makes, recorded; the workers' check answers
    `problem` (None: the checkpoint fits)."""

    def __init__(self, problem: str | None = None) -> None:
        self.problem = problem
        self.calls: list[str] = []

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.calls.append(method)
        return [self.problem] if method == "orchestrator_check_weights" else [0.01]

    async def pause_generation(self, *, mode: str) -> None:
        self.calls.append(f"pause:{mode}")

    async def reset_prefix_cache(self) -> None:
        self.calls.append("reset_prefix_cache")

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(f"version:{version}")

    async def resume_generation(self) -> None:
        self.calls.append("resume")


class AuthenticationMiddleware:
    """Stands in for vLLM's, as Starlette registers it (`app.user_middleware`)."""


def vllm_app(engine: RecordingEngine, tokens: list[str]) -> Any:
    registered = [SimpleNamespace(cls=AuthenticationMiddleware, kwargs={"tokens": tokens})]
    return SimpleNamespace(state=SimpleNamespace(engine_client=engine), user_middleware=registered)


def update_call(
    app: Any, body: dict[str, Any], headers: list[tuple[bytes, bytes]]
) -> tuple[int, dict]:
    """One POST /update_weights through the writer, with `app` as the scope's app."""
    sent: list[dict[str, Any]] = []

    async def run() -> None:
        messages = [{"type": "http.request", "body": json.dumps(body).encode()}]

        async def receive() -> dict[str, Any]:
            return messages.pop(0)

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/update_weights",
            "root_path": "",
            "headers": headers,
            "app": app,
        }
        await PayloadWriter(FakeVLLM({}, 200), WriterSettings())(scope, receive, send)

    asyncio.run(run())
    return sent[0]["status"], json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


def test_update_weights_loads_in_order_and_resumes(tmp_path: Path) -> None:
    engine = RecordingEngine()
    weights = tmp_path / "step_7"
    status, answer = update_call(vllm_app(engine, []), {"weight_dir": str(weights)}, [])
    assert status == 200 and answer["version"] == "7", answer
    assert engine.calls == [
        "orchestrator_check_weights",
        "pause:keep",
        "orchestrator_load_weights",
        "reset_prefix_cache",
        "version:7",
        "resume",
    ]


def test_update_weights_refused_by_the_check_touches_nothing(tmp_path: Path) -> None:
    engine = RecordingEngine(problem="the checkpoint is partial: x missing")
    weights = str(tmp_path / "step_2")
    status, answer = update_call(vllm_app(engine, []), {"weight_dir": weights}, [])
    assert status == 400
    assert (
        answer["error"]["message"] == f"cannot load {weights}: the checkpoint is partial: x missing"
    )
    assert engine.calls == ["orchestrator_check_weights"]
    status, answer = update_call(vllm_app(engine, []), {"weight_dir": "relative"}, [])
    assert status == 400 and "absolute" in answer["error"]["message"]


def test_update_weights_wants_the_servers_bearer_token(tmp_path: Path) -> None:
    engine = RecordingEngine()
    app = vllm_app(engine, ["sk-right"])
    body = {"weight_dir": str(tmp_path / "step_1")}
    for headers in (
        [],
        [(b"authorization", b"Bearer sk-wrong")],
        [(b"authorization", b"sk-right")],
    ):
        assert update_call(app, body, headers) == (401, {"error": "Unauthorized"})
    assert engine.calls == []
    status, _ = update_call(app, body, [(b"authorization", b"Bearer sk-right")])
    assert status == 200 and engine.calls[-1] == "resume"


def test_a_checkpoint_may_leave_out_a_head_tied_to_the_embeddings(tmp_path: Path) -> None:
    from orchestrator_vllm.checkpoints import checkpoint_problem, ties_head

    (tmp_path / "config.json").write_text('{"tie_word_embeddings": true}')
    assert ties_head(str(tmp_path))
    (tmp_path / "config.json").write_text('{"text_config": {"tie_word_embeddings": false}}')
    assert not ties_head(str(tmp_path / "missing")) and not ties_head(str(tmp_path))

    model = {"embed.weight": ("F32", (8, 4)), "lm_head.weight": ("F32", (8, 4))}
    saved = {"embed.weight": ("F32", (8, 4))}  # save_pretrained of a tied model
    tied = frozenset({"lm_head.weight"})
    assert checkpoint_problem(model, saved, tied=tied) is None
    assert checkpoint_problem(model, model, tied=tied) is None
    assert checkpoint_problem(model, saved) == "the checkpoint is partial: lm_head.weight missing"
    wrong = {"embed.weight": ("F32", (8, 5))}
    assert "does not fit the model" in str(checkpoint_problem(model, wrong, tied=tied))

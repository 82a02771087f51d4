"""The model's tokenizer and chat template (orchestrator.tasks.chat) and the demo's files."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import trio

# Nothing here may reach the Hugging Face hub; set before transformers is first imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from orchestrator.errors import UserError
from orchestrator.tasks.chat import (
    INLINE_DECODE_TOKENS,
    BridgeError,
    ChatTokenizer,
    TokenizerError,
    decode_completions,
)

DEMO = Path(__file__).resolve().parents[2] / "demo"
MODEL = DEMO / "model"

TIMES = "\N{MULTIPLICATION SIGN}"
IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.load(MODEL, require_chat_template=True)


def _ids(chat: ChatTokenizer, text: str) -> list[int]:
    """`text` tokenized as the model would have sampled it (special tokens parsed)."""
    return list(chat.tokenizer(text, add_special_tokens=False)["input_ids"])


def _token_id(chat: ChatTokenizer, token: str) -> int:
    return int(chat.tokenizer.convert_tokens_to_ids(token))


def _full_render(chat: ChatTokenizer, messages: Sequence[dict[str, str]]) -> list[int]:
    """The conversation re-rendered from its messages, as a naive multi-turn loop would."""
    ids = chat.tokenizer.apply_chat_template(
        list(messages), tokenize=True, add_generation_prompt=True, return_dict=False
    )
    return list(ids)


def _copy_model(tmp_path: Path, *names: str) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    for name in names:
        shutil.copy(MODEL / name, folder / name)
    return folder


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value), encoding="utf-8")


def _rows(name: str) -> list[dict[str, Any]]:
    lines = (DEMO / "data" / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def _load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"demo_{name}", DEMO / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- loading, rendering, stop ids, decoding ---------------------------------------------


def test_demo_tokenizer_loads(chat: ChatTokenizer) -> None:
    assert chat.vocab_size == 1024
    for token in (ENDOFTEXT, IM_START, IM_END, "<think>", "</think>"):
        assert 0 <= _token_id(chat, token) < chat.vocab_size
        assert chat.tokenizer.convert_ids_to_tokens(_token_id(chat, token)) == token


def test_render_prompt_is_apply_chat_template_tokenized(chat: ChatTokenizer) -> None:
    for row in _rows("chat.jsonl")[:5]:
        messages = row["messages"]
        prompt = chat.render_prompt(messages)
        assert prompt.dtype == np.int32
        assert not prompt.flags.writeable
        assert prompt.tolist() == _full_render(chat, messages)
        text = chat.tokenizer.decode(prompt.tolist())
        assert text.startswith(f"{IM_START}system\n")
        assert text.endswith(f"{IM_END}\n{IM_START}assistant\n")


def test_render_prompt_adds_special_tokens_once(tmp_path: Path) -> None:
    # A tokenizer whose post-processor prepends a BOS and whose template writes one too:
    # tokenizing the rendered text with special tokens would start with two (vLLM's chat
    # endpoint and apply_chat_template tokenize with add_special_tokens=False).
    from tokenizers import Tokenizer, processors

    folder = _copy_model(tmp_path, "generation_config.json")
    backend = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    bos = backend.token_to_id(ENDOFTEXT)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{ENDOFTEXT} $A", special_tokens=[(ENDOFTEXT, bos)]
    )
    backend.save(str(folder / "tokenizer.json"))
    config = json.loads((MODEL / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["bos_token"] = ENDOFTEXT
    config["chat_template"] = "{{ bos_token }}" + config["chat_template"]
    _write_json(folder / "tokenizer_config.json", config)
    with_bos = ChatTokenizer.load(folder)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]

    prompt = with_bos.render_prompt(messages).tolist()

    assert prompt[:2] == [bos, _token_id(with_bos, IM_START)]
    assert prompt == _full_render(with_bos, messages)
    text = with_bos.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert with_bos.tokenizer(text)["input_ids"][:2] == [bos, bos]


def test_render_prompt_tokenizes_through_the_rust_backend_as_transformers_would(
    tmp_path: Path,
) -> None:
    # The fast path (the backend's encode_batch_fast) is taken on the demo's tokenizer and
    # gives transformers' ids; a tokenizer.json that carries a truncation of its own (which
    # transformers' call turns off) does not truncate a prompt on either path.
    from tokenizers import Tokenizer

    from orchestrator.tasks.chat import _fast_encoder

    folder = _copy_model(tmp_path, "generation_config.json", "tokenizer_config.json")
    backend = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    backend.enable_truncation(max_length=8)
    backend.save(str(folder / "tokenizer.json"))
    truncating = ChatTokenizer.load(folder)
    messages = [{"role": "user", "content": "What is 12 + 30? " * 20}]

    for chat in (ChatTokenizer.load(MODEL), truncating, truncating):
        prompt = chat.render_prompt(messages).tolist()
        assert len(prompt) > 8
        assert prompt == _full_render(chat, messages)
        assert _fast_encoder(chat.tokenizer) is not None  # the next render takes it


def test_stop_ids_are_the_generation_configs_eos_ids(chat: ChatTokenizer) -> None:
    config = json.loads((MODEL / "generation_config.json").read_text(encoding="utf-8"))
    assert chat.stop_token_ids == (_token_id(chat, IM_END), _token_id(chat, ENDOFTEXT))
    assert list(chat.stop_token_ids) == config["eos_token_id"]
    # The tokenizer's own eos comes first, as vLLM's primary eos.
    assert chat.stop_token_ids[0] == chat.tokenizer.eos_token_id


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # No generation config: the tokenizer's eos id alone.
        ({}, ("<|im_end|>",)),
        # An int rather than a list, and the tokenizer's eos not among them.
        ({"generation_config.json": {"eos_token_id": 0}}, ("<|im_end|>", "<|endoftext|>")),
        # Without generation_config.json, config.json's eos_token_id (as vLLM falls back).
        ({"config.json": {"eos_token_id": [0]}}, ("<|im_end|>", "<|endoftext|>")),
        # generation_config.json wins over config.json.
        (
            {"generation_config.json": {"eos_token_id": [2]}, "config.json": {"eos_token_id": 0}},
            ("<|im_end|>",),
        ),
    ],
)
def test_stop_ids_without_or_with_other_configs(
    tmp_path: Path, files: dict[str, Any], expected: tuple[str, ...]
) -> None:
    folder = _copy_model(tmp_path, "tokenizer.json", "tokenizer_config.json")
    for name, value in files.items():
        _write_json(folder / name, value)
    loaded = ChatTokenizer.load(folder)
    assert loaded.stop_token_ids == tuple(_token_id(loaded, token) for token in expected)


def test_decode_skips_special_tokens_but_keeps_reasoning_tags(chat: ChatTokenizer) -> None:
    ids = _ids(chat, f"<think>\nadd them\n</think>\n\n42{IM_END}{ENDOFTEXT}")
    assert ids[-2:] == list(chat.stop_token_ids)
    assert chat.decode(ids) == "<think>\nadd them\n</think>\n\n42"
    assert chat.decode(np.asarray(ids[-2:], dtype=np.int32)) == ""


def test_transformers_logs_through_the_root_logger(chat: ChatTokenizer) -> None:
    # Its own stderr handler would write plain lines into the daemon's JSON-lines log.
    library = logging.getLogger("transformers")
    assert library.handlers == []
    assert library.propagate


@pytest.mark.slow
def test_loading_writes_nothing_to_stderr() -> None:
    # A fresh interpreter: transformers logs "PyTorch was not found" at its import unless
    # advisories are switched off, which loading the tokenizer does first.
    script = (
        "from pathlib import Path\n"
        "from orchestrator.tasks.chat import ChatTokenizer\n"
        f"ChatTokenizer.load(Path({str(MODEL)!r}), require_chat_template=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSFORMERS_")}
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=120,
    )
    assert (done.returncode, done.stderr) == (0, "")


# --- bridging -----------------------------------------------------------------------------

USERS = (
    "What is 2 + 3?",
    "Add 10 to it.",
    f"What is 6 {TIMES} 7?",
    "And 9 + 9?",
    "Thanks. What is 1 + 1?",
)
# What the model sampled at each turn: plain and stopped on <|im_end|>; truncated by
# max_tokens; reasoning then an answer; truncated inside its reasoning.
COMPLETIONS = (
    f"5{IM_END}",
    "The sum is 1",
    f"<think>\nseven times six\n</think>\n\n42{IM_END}",
    "<think>\nnine plus nine is",
)


def test_bridge_keeps_every_sampled_token_over_four_turns(chat: ChatTokenizer) -> None:
    newline = _ids(chat, "\n")
    im_end = _token_id(chat, IM_END)
    conversation = [{"role": "user", "content": USERS[0]}]
    prompt = chat.render_prompt(conversation)
    reasoning_seen = False

    for turn, text in enumerate(COMPLETIONS):
        completion = _ids(chat, text)
        new_user = {"role": "user", "content": USERS[turn + 1]}
        conversation += [{"role": "assistant", "content": chat.decode(completion)}, new_user]

        bridged = chat.bridge(prompt, completion, [new_user])

        assert bridged.dtype == np.int32
        sampled = len(prompt) + len(completion)
        assert bridged[:sampled].tolist() == prompt.tolist() + completion
        after = bridged[sampled:].tolist()
        if text.endswith(IM_END):
            # The model wrote the close's <|im_end|>; only its newline is added.
            assert after[: len(newline)] == newline
        else:
            # Truncated: the bridge closes the turn itself.
            assert after[0] == im_end
        assert chat.decode(bridged).endswith(f"{USERS[turn + 1]}\nassistant\n")

        full = _full_render(chat, conversation)
        reasoning_seen = reasoning_seen or "</think>" in text
        if not reasoning_seen:
            # Where the conversation as the model saw it re-renders to the same tokens, the
            # bridge is exactly that render.
            assert bridged.tolist() == full
        else:
            # The template drops the reasoning of earlier turns, so a re-render is not
            # what the model saw: it changes tokens inside a sampled completion.
            assert bridged.tolist() != full
            assert "seven times six" in chat.decode(bridged)
            assert "seven times six" not in chat.decode(full)
            first_difference = next(
                i for i, (a, b) in enumerate(zip(bridged.tolist(), full, strict=False)) if a != b
            )
            assert first_difference < sampled
        prompt = bridged


def test_bridge_closes_a_turn_stopped_by_an_eos_that_is_not_the_close(
    chat: ChatTokenizer,
) -> None:
    prompt = chat.render_prompt([{"role": "user", "content": USERS[0]}])
    completion = _ids(chat, f"5{ENDOFTEXT}")
    new_user = {"role": "user", "content": USERS[1]}

    bridged = chat.bridge(prompt, completion, [new_user])

    rest = bridged[len(prompt) + len(completion) :].tolist()
    expected = f"{IM_END}\n{IM_START}user\n{USERS[1]}{IM_END}\n{IM_START}assistant\n"
    assert rest == _ids(chat, expected)


def test_bridge_renders_several_new_messages_as_the_template_does(chat: ChatTokenizer) -> None:
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = chat.render_prompt(conversation)
    completion = _ids(chat, f"Hello{IM_END}")
    new = [{"role": "system", "content": "Now count."}, {"role": "user", "content": "1 2 3?"}]

    bridged = chat.bridge(prompt, completion, new)

    messages = [*conversation, {"role": "assistant", "content": "Hello"}, *new]
    assert bridged.tolist() == _full_render(chat, messages)


def test_bridge_anchors_at_the_generation_prompt_not_a_rendered_reply(
    chat: ChatTokenizer,
) -> None:
    # Like Qwen3's, the demo template gives a final assistant turn an empty <think> block
    # that it drops once a user message follows: a render of [user, assistant] is not a
    # prefix of the longer conversation's, while the generation prompt plus the reply is.
    user = {"role": "user", "content": "x"}
    reply = {"role": "assistant", "content": "y"}
    follow = {"role": "user", "content": "z"}
    template = chat.tokenizer.apply_chat_template
    alone = template([user, reply], tokenize=False)
    longer = template([user, reply, follow], tokenize=False, add_generation_prompt=True)
    seen = template([user], tokenize=False, add_generation_prompt=True) + "y"
    assert not longer.startswith(alone)
    assert longer.startswith(seen)


def test_a_template_that_rewrites_earlier_turns_cannot_be_bridged(tmp_path: Path) -> None:
    folder = _copy_model(tmp_path, "tokenizer.json", "generation_config.json")
    config = json.loads((MODEL / "tokenizer_config.json").read_text(encoding="utf-8"))
    # A header that counts the messages changes the start of every render.
    config["chat_template"] = "{{ messages | length }} messages\n" + config["chat_template"]
    _write_json(folder / "tokenizer_config.json", config)
    counting = ChatTokenizer.load(folder, require_chat_template=True)
    prompt = counting.render_prompt([{"role": "user", "content": USERS[0]}])

    with pytest.raises(BridgeError, match="bridging cannot be proven") as raised:
        counting.bridge(prompt, _ids(counting, f"5{IM_END}"), [{"role": "user", "content": "?"}])
    assert "\n" not in str(raised.value)
    assert isinstance(raised.value, UserError)


def test_bridge_needs_new_messages(chat: ChatTokenizer) -> None:
    prompt = chat.render_prompt([{"role": "user", "content": USERS[0]}])
    with pytest.raises(ValueError, match="at least one new message"):
        chat.bridge(prompt, _ids(chat, f"5{IM_END}"), [])


# --- loading errors -----------------------------------------------------------------------


def _load_error(folder: Path, *, require_chat_template: bool = False) -> str:
    with pytest.raises(TokenizerError) as raised:
        ChatTokenizer.load(folder, require_chat_template=require_chat_template)
    assert isinstance(raised.value, UserError)
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_missing_folder(tmp_path: Path) -> None:
    assert "does not exist" in _load_error(tmp_path / "absent")
    (tmp_path / "file").write_text("not a folder", encoding="utf-8")
    assert "is not a folder" in _load_error(tmp_path / "file")


def test_folder_without_tokenizer_files(tmp_path: Path) -> None:
    folder = _copy_model(tmp_path, "generation_config.json")
    _write_json(folder / "config.json", {"model_type": "qwen3"})
    assert "has no tokenizer files" in _load_error(folder)


def test_folder_whose_tokenizer_cannot_be_built(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    _write_json(folder / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast"})
    assert "cannot load the tokenizer" in _load_error(folder)


def test_folder_whose_tokenizer_json_is_corrupt(tmp_path: Path) -> None:
    folder = _copy_model(tmp_path, "tokenizer_config.json")
    backend = json.loads((MODEL / "tokenizer.json").read_text(encoding="utf-8"))
    backend["model"]["type"] = "NoSuchModel"
    _write_json(folder / "tokenizer.json", backend)
    assert "cannot load the tokenizer" in _load_error(folder)


def test_no_chat_template_when_one_is_required(tmp_path: Path) -> None:
    folder = _copy_model(tmp_path, "tokenizer.json", "generation_config.json")
    assert "has no chat template" in _load_error(folder, require_chat_template=True)
    # Not required: it loads, and rendering says what is missing.
    plain = ChatTokenizer.load(folder)
    with pytest.raises(TokenizerError, match="has no chat template"):
        plain.render_prompt([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("eos", ["two", [2, "x"], True, -1])
def test_malformed_generation_config(tmp_path: Path, eos: object) -> None:
    folder = _copy_model(tmp_path, "tokenizer.json", "tokenizer_config.json")
    _write_json(folder / "generation_config.json", {"eos_token_id": eos})
    assert "eos_token_id must be a token id" in _load_error(folder)


def test_unreadable_generation_config(tmp_path: Path) -> None:
    folder = _copy_model(tmp_path, "tokenizer.json", "tokenizer_config.json")
    (folder / "generation_config.json").write_text("{not json", encoding="utf-8")
    assert "cannot read" in _load_error(folder)


# --- the demo's committed files -----------------------------------------------------------


def test_demo_datasets_are_what_make_data_writes() -> None:
    make_data = _load_script("make_data")
    for name, text in make_data.datasets().items():
        assert (DEMO / "data" / name).read_text(encoding="utf-8") == text, name


def test_demo_datasets_shape() -> None:
    arith = _rows("arith.jsonl")
    assert len(arith) == 400
    for row in arith:
        assert set(row) == {"question", "answer"}
        assert int(row["answer"]) >= 0
    operators = ("+", "-", TIMES)
    used = {op for row in arith for op in operators if f" {op} " in row["question"]}
    assert used == set(operators)
    chat_rows = _rows("chat.jsonl")
    assert len(chat_rows) == 100
    for row in chat_rows:
        assert [m["role"] for m in row["messages"]] == ["system", "user"]
        assert row["answer"].isdigit()


def test_demo_model_is_what_make_model_writes() -> None:
    # Training is bit-deterministic for the locked `tokenizers` version, so the committed
    # files are compared byte for byte.
    make_model = _load_script("make_model")
    files = make_model.model_files()
    assert sorted(files) == sorted(path.name for path in MODEL.iterdir())
    for name, text in files.items():
        assert (MODEL / name).read_text(encoding="utf-8") == text, name


def test_demo_tokenizer_round_trips_the_datasets(chat: ChatTokenizer) -> None:
    for row in _rows("arith.jsonl")[:50]:
        question = row["question"]
        assert chat.decode(_ids(chat, question)) == question


def test_bridge_takes_lists_and_an_empty_completion(chat: ChatTokenizer) -> None:
    prompt = chat.render_prompt([{"role": "user", "content": USERS[0]}]).tolist()
    new_user = {"role": "user", "content": USERS[1]}

    bridged = chat.bridge(prompt, [], [new_user])

    assert bridged[: len(prompt)].tolist() == prompt
    assert bridged[len(prompt)] == _token_id(chat, IM_END)
    with pytest.raises(ValueError, match="one-dimensional"):
        chat.bridge([prompt], [], [new_user])


def test_template_kwargs_reach_every_render_and_the_bridge_keeps_the_prefill() -> None:
    # Qwen3's enable_thinking=false: the generation prompt pre-fills an empty think block
    # that the history does not write; the bridge keeps it, as the model saw it.
    quiet = ChatTokenizer.load(MODEL, template_kwargs={"enable_thinking": False})
    user = [{"role": "user", "content": USERS[0]}]
    prompt = quiet.render_prompt(user)
    assert quiet.tokenizer.decode(prompt.tolist()).endswith(
        f"{IM_START}assistant\n<think>\n\n</think>\n\n"
    )
    completion = _ids(quiet, f"42{IM_END}")
    bridged = quiet.bridge(prompt, completion, [{"role": "user", "content": USERS[1]}])
    sampled = len(prompt) + len(completion)
    assert bridged[:sampled].tolist() == prompt.tolist() + completion
    text = quiet.tokenizer.decode(bridged[sampled:].tolist())
    assert (
        text
        == f"\n{IM_START}user\n{USERS[1]}{IM_END}\n{IM_START}assistant\n<think>\n\n</think>\n\n"
    )


async def test_completions_decode_alike_on_the_loop_and_in_a_thread(
    chat: ChatTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = _ids(chat, "The answer is 42, and 7 + 5 = 12.")
    short = [np.array(ids), np.array(ids[:3])]
    # Long enough for a worker thread: the same text as one decode call, in order.
    long = [np.array(ids * (INLINE_DECODE_TOKENS // len(ids) + 1)), np.array(ids)]
    threads: list[object] = []
    real = trio.to_thread.run_sync

    async def counted(*args: Any, **kwargs: Any) -> Any:
        threads.append(args[0])
        return await real(*args, **kwargs)

    monkeypatch.setattr(trio.to_thread, "run_sync", counted)
    limiter = trio.CapacityLimiter(1)
    assert await decode_completions(chat, short, limiter) == [chat.decode(i) for i in short]
    assert threads == []
    assert await decode_completions(chat, long, limiter) == [chat.decode(i) for i in long]
    assert len(threads) == 1


def test_tokenizers_load_side_by_side_in_a_fresh_process() -> None:
    # transformers' lazy module is not thread-safe on first use: threads that load at
    # once (check-config's environments) once failed with "module 'transformers' has no
    # attribute 'AutoTokenizer'". A fresh process: here transformers is imported already.
    script = (
        "import sys, threading\n"
        "from concurrent.futures import ThreadPoolExecutor\n"
        "from pathlib import Path\n"
        "from orchestrator.tasks.chat import ChatTokenizer\n"
        "start = threading.Barrier(12)\n"
        "def load(_):\n"
        "    start.wait()\n"
        "    return ChatTokenizer.load(Path(sys.argv[1])).vocab_size\n"
        "with ThreadPoolExecutor(12) as pool:\n"
        "    print(sorted(set(pool.map(load, range(12)))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(MODEL)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"[{ChatTokenizer.load(MODEL).vocab_size}]"

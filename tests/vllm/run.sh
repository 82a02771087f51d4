#!/usr/bin/env bash
# `make test-vllm` / `make test-trainer` / `make demo-vllm` / `make demo-learn` /
# `make demo-learn-real`: the stage's venv (installed once, cached outside the
# clone), then the tests (or the demo) with it. Where the pinned vLLM cannot be installed
# (no package registry), say so and skip, as the network-mount mode does.
set -euo pipefail
cd "$(dirname "$0")/../.."
what="${1:-test}"
shift || true
status=0
python="$(python3 tests/vllm/vllm_env.py ensure)" || status=$?
if [ "$status" -eq 3 ]; then
    echo "test-vllm: skipped: the pinned vLLM (tests/vllm/requirements.txt) cannot be installed here"
    exit 0
elif [ "$status" -ne 0 ]; then
    exit "$status"
fi
export ORCH_VLLM_PYTHON="$python"
if [ "$what" = demo ]; then
    exec ${RUN:-uv run --frozen --python python3} python tests/vllm/demo_vllm.py "$@"
fi
# The reference trainer beside vLLM, for its own tests and the learning run.
python3 tests/vllm/install_trainer.py "$python" >/dev/null
if [ "$what" = learn ]; then
    exec ${RUN:-uv run --frozen --python python3} python tests/vllm/demo_learn.py "$@"
elif [ "$what" = learn-real ]; then
    # reasoning-gym for the task's data and its scorer in the reward workers: the
    # project's `real-tasks` group, added beside what is installed (nothing removed).
    ${UV:-uv} sync --frozen --python python3 --quiet --compile-bytecode --inexact --group real-tasks
    exec ${RUN:-uv run --frozen --python python3} python tests/vllm/demo_learn_real.py "$@"
elif [ "$what" = trainer ]; then
    ORCH_TRAINER_TESTS=1 exec "$python" -m pytest -q -p no:cacheprovider tests/trainer "$@"
fi
ORCH_TRAINER_TESTS=1 "$python" -m pytest -q -p no:cacheprovider tests/trainer
exec ${RUN:-uv run --frozen --python python3} pytest -q tests/vllm "$@"

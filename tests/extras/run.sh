#!/usr/bin/env bash
# `make test-extras`: rewards on a local Ray instance, metrics to W&B offline. Installs the
# `ray` and `wandb` extras into the project's environment (uv's cache, outside the clone,
# keeps the wheels); where they cannot be installed, say so and skip.
set -euo pipefail
cd "$(dirname "$0")/../.."
UV="${UV:-uv}"
if ! $UV sync --frozen --inexact --python python3 --quiet --compile-bytecode --extra ray --extra wandb; then
    echo "test-extras: skipped: the ray and wandb extras cannot be installed here"
    exit 0
fi
ORCH_TEST_EXTRAS=1 $UV run --frozen --python python3 --extra ray --extra wandb pytest -q tests/extras "$@"

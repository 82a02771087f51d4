"""What only the orchestrator's tree needs: the stages collected only when asked for. The
fixtures and hooks every test shares (logging reset, `bind_mount`, `shared_fs` marks, the
`slow` tests first, the network-mount mode) are tests/support/suite_plugin.py, shared
with payload-gc's tests (`payload-gc/tests/`).

**The real-vLLM stage.** `tests/vllm` runs only with `ORCH_VLLM_PYTHON` set (`make
test-vllm`, which installs the stage's venv): without it those tests are not collected, so
the rest of the suite never starts a vLLM server nor reports them as skipped. Likewise
`tests/browser` (`ORCH_BROWSER`, `make test-browser`: Chromium and Playwright) and
`tests/extras` (`ORCH_TEST_EXTRAS`, `make test-extras`: the `ray` and `wandb` extras), and
`tests/trainer` (`ORCH_TRAINER_TESTS`, `make test-trainer`: the reference trainer, which
needs torch, run by the real-vLLM stage's venv).
"""

from __future__ import annotations

import os

# Where the tests of mount points name the `bind_mount` fixture's type.
from suite_plugin import BindMount as BindMount

collect_ignore = [
    *([] if os.environ.get("ORCH_VLLM_PYTHON") else ["vllm"]),
    # The reference trainer's tests need torch: run by its stage's venv (ORCH_TRAINER_TESTS).
    *([] if os.environ.get("ORCH_TRAINER_TESTS") else ["trainer"]),
    # The stages with heavy extras (tests/browser/run.sh, tests/extras/run.sh) set these.
    *([] if os.environ.get("ORCH_BROWSER") else ["browser"]),
    *([] if os.environ.get("ORCH_TEST_EXTRAS") else ["extras"]),
]

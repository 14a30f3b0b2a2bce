# The two commands of the README. Both set up .venv first (idempotent, instant when done).
.PHONY: setup train test ui lock plugin

setup:
	@bash scripts/setup.sh

# Version 0 (the built-in model and its supervised warm-ups) is made once, before the first launch, which starts
# from it; later launches continue from the newest policies.
train: setup
	.venv/bin/marl prepare configs/demo.yaml
	.venv/bin/marl train configs/demo.yaml

# Two pytest workers (pytest-xdist), each module whole to one: first one takes the modules that share kept actors, the
# other the launches without the suite's Ray, then both the rest (tests/conftest.py). The cores sat idle 28% of a
# one-process run: 26-28 minutes against 35 min 30 s on a 2-core Xeon (docs/decisions/0001-how-the-suite-runs.md).
# `make test TEST_WORKERS=4` on a bigger machine.
TEST_WORKERS ?= 2
test: setup
	.venv/bin/pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# Install an environment plugin into .venv (P=a directory, editable, or a package name); every later set-up keeps it.
plugin:
	@bash scripts/setup.sh plugin "$(P)"

ui: setup
	mkdir -p .dagster_home && touch .dagster_home/dagster.yaml
	DAGSTER_HOME=$(CURDIR)/.dagster_home .venv/bin/dagster dev -w workspace.yaml

# Refresh uv.lock after changing dependencies in pyproject.toml (ARGS=--upgrade: newest versions).
lock:
	@bash scripts/setup.sh lock $(ARGS)

# The two commands of the README. Both set up .venv first (idempotent, instant when done).
.PHONY: setup train test ui lock

setup:
	@bash scripts/setup.sh

train: setup
	.venv/bin/marl train configs/demo.yaml

# Two pytest workers, a test file each (its module-scoped Ray and engines stay in one process): the suite mostly
# waits (engine and Ray start-up, Dagster runs, sensor ticks), so two overlap on 2 cores (BENCHMARKS.md, suite time).
TEST_WORKERS ?= 2
test: setup
	.venv/bin/pytest -n $(TEST_WORKERS) --dist loadfile

ui: setup
	mkdir -p .dagster_home && touch .dagster_home/dagster.yaml
	DAGSTER_HOME=$(CURDIR)/.dagster_home .venv/bin/dagster dev -w workspace.yaml

# Refresh uv.lock after changing dependencies in pyproject.toml (ARGS=--upgrade: newest versions).
lock:
	@bash scripts/setup.sh lock $(ARGS)

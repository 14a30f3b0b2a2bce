# The two commands of the README. Both set up .venv first (idempotent, instant when done).
.PHONY: setup train test ui lock plugin

setup:
	@bash scripts/setup.sh

# Version 0 (the built-in model and its supervised warm-ups) is made once, before the first launch, which starts
# from it; later launches continue from the newest policies.
train: setup
	.venv/bin/marl prepare configs/demo.yaml
	.venv/bin/marl train configs/demo.yaml

# One pytest process: two workers (pytest-xdist, by file) were no faster on 2 cores (30 min for 336 tests, about
# what one process takes) and made the action pool's hedging tests miss their timings (BENCHMARKS.md, suite
# time). `make test PYTEST_ARGS="-n 4"` on a bigger machine.
test: setup
	.venv/bin/pytest $(PYTEST_ARGS)

# Install an environment plugin into .venv (P=a directory, editable, or a package name); every later set-up keeps it.
plugin:
	@bash scripts/setup.sh plugin "$(P)"

ui: setup
	mkdir -p .dagster_home && touch .dagster_home/dagster.yaml
	DAGSTER_HOME=$(CURDIR)/.dagster_home .venv/bin/dagster dev -w workspace.yaml

# Refresh uv.lock after changing dependencies in pyproject.toml (ARGS=--upgrade: newest versions).
lock:
	@bash scripts/setup.sh lock $(ARGS)

"""The layering of docs/ARCHITECTURE.md is a contract: import-linter checks it, and a broken one fails here."""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("marl_pipeline", "assets", "resources", "environments")
LINT_IMPORTS = str(Path(sys.executable).with_name("lint-imports"))


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}  # the packages under cwd, not the installed ones
    return subprocess.run([LINT_IMPORTS, "--config", "pyproject.toml", "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_import_contracts_hold() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_broken_contract_fails(tmp_path: Path) -> None:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    # The engine reaching up into the Dagster layer: what the first contract forbids.
    recipe = tmp_path / "marl_pipeline" / "run" / "recipe.py"
    recipe.write_text(recipe.read_text() + "\nimport assets.definitions  # noqa\n")
    # A store module importing the orchestrator: a layer pointing the wrong way.
    schema = tmp_path / "marl_pipeline" / "store" / "schema.py"
    schema.write_text(schema.read_text() + "\nimport marl_pipeline.run.orchestrator  # noqa\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0
    assert "the engine is Dagster-free" in result.stdout and "BROKEN" in result.stdout
    assert "marl_pipeline.store.schema -> marl_pipeline.run.orchestrator" in result.stdout


def test_modules_stay_small() -> None:
    lengths = {path.relative_to(ROOT): len(path.read_text().splitlines())
               for path in (ROOT / "marl_pipeline").rglob("*.py") if path.name != "__init__.py"}
    too_long = {str(path): n for path, n in lengths.items() if n > 400}
    assert not too_long, f"modules over 400 lines: {too_long}"
    assert statistics.median(lengths.values()) <= 150


def test_the_module_map_is_current_and_names_every_module() -> None:
    """docs/modules.md is what scripts/module_map.py writes from the docstrings now, every module has a docstring to
    give it, and the architecture page's layer picture shows each subpackage."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("module_map", ROOT / "scripts" / "module_map.py")
    module_map = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module_map)
    assert (ROOT / "docs" / "modules.md").read_text() == module_map.module_map(), \
        "docs/modules.md is stale: run .venv/bin/python scripts/module_map.py"
    modules = [path for path in (ROOT / "marl_pipeline").rglob("*.py") if path.name != "__init__.py"]
    assert [str(path.relative_to(ROOT)) for path in modules if not module_map.first_sentence(path)] == []
    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    subpackages = [path.parent.name for path in (ROOT / "marl_pipeline").glob("*/__init__.py")]
    assert [name for name in subpackages if f"  {name}/" not in page] == []  # the layer picture shows each one


def test_no_private_dagster_api() -> None:
    # Dagster's underscore modules change without notice between releases; the public `dagster` namespace only.
    sources = [path for folder in ("marl_pipeline", "assets", "resources", "environments", "tests", "bench")
               for path in (ROOT / folder).rglob("*.py")]
    private = [str(path.relative_to(ROOT)) for path in sources
               if re.search(r"^\s*(from|import) dagster(_\w+)?\._", path.read_text(), re.M)]
    assert private == []


def test_the_architecture_page_lists_every_launch_event() -> None:
    from marl_pipeline.run import events

    page = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = page[page.index("## Launches, resume and exactly-once"):]
    paragraph = section.split("\n\n")[1]  # the one that says what a launch yields
    documented = {name for name in re.findall(r"`(\w+)`", paragraph) if name[0].isupper()}
    assert documented == {kind.__name__ for kind in typing.get_args(events.LaunchEvent)}


ACTOR_NAME = re.compile(r"""f["'][^"'\n]*\}/(engine|trainer)|engine\+trainer["']|["']trainer-worker-""")
"""An actor's name spelled out: ``f"{agent}/trainer"``, ``f"{agent}/engine/{k}"``, ``"...engine+trainer"``,
``"trainer-worker-..."``."""


def test_an_actors_name_is_spelled_in_one_place() -> None:
    """cluster/specs.py names every actor (``trainer_name``, ``engine_names``, ``process_name``, ``WORKER``); any
    other module asks it, so the plan, the placement, the core split and the summaries agree on each name."""
    spelled = [f"{path.relative_to(ROOT)}:{number}" for path in sorted((ROOT / "marl_pipeline").rglob("*.py"))
               for number, line in enumerate(path.read_text().splitlines(), 1)
               if ACTOR_NAME.search(line) and path != ROOT / "marl_pipeline" / "cluster" / "specs.py"]
    assert spelled == []
    assert ACTOR_NAME.search('names = [f"{agent}/engine/{k}" for k in range(2)]')  # what it catches


def test_the_planner_simulates_the_orchestrators_rules_by_calling_them() -> None:
    """planner/ calls the rules the run schedules by (issue 71.3): it never routes an episode or syncs a replica by
    hand (the router's bookkeeping only through ``EpisodeRoute`` and ``rolling_sync``), and defines no function of
    the rules' names (the staleness gate, who learns, when a sync is due: run/queues.py), nor keeps a step clock of
    its own (``StepClock``)."""
    import ast

    from marl_pipeline.run import queues

    bookkeeping = {"acquire", "release", "lane", "forget", "set_draining", "mark_down", "mark_up"}
    rules = {name for name, value in vars(queues).items() if callable(value) and not isinstance(value, type)
             and getattr(value, "__module__", None) == queues.__name__}
    assert {"gate_open", "sync_due", "learners"} <= rules
    found = []
    for path in sorted((ROOT / "marl_pipeline" / "planner").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in rules:
                found.append(f"{path.name}:{node.lineno} defines {node.name}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in bookkeeping
                    and not re.fullmatch(r"route|routes\[.*\]", ast.unparse(node.func.value))):
                found.append(f"{path.name}:{node.lineno} calls {ast.unparse(node.func)}")
            if isinstance(node, ast.Assign) and any(  # the step clock's state kept by hand (queues.StepClock)
                    isinstance(target, ast.Attribute) and target.attr in {"last_end", "step_started"}
                    for target in node.targets):
                found.append(f"{path.name}:{node.lineno} keeps a step clock of its own")
    assert not found, found
    assert "StepClock()" in (ROOT / "marl_pipeline" / "planner" / "simulate.py").read_text()


def test_bench_is_topic_folders_of_modules_each_mapped_to_its_benchmarks_section() -> None:
    """bench/ (issue 71.4): every script in a topic folder, run as a module from the repository root (``python -m
    bench.<topic>.<script>``), so none edits ``sys.path`` to find another; each named in bench/README.md; every
    launch through the one harness, bench/launch.py; and the baselines the tests compare with live in tests/."""
    harness = ROOT / "bench" / "launch.py"
    scripts = [path for path in (ROOT / "bench").rglob("*.py") if path.name != "__init__.py" and path != harness]
    assert [str(path.relative_to(ROOT)) for path in scripts if path.parent == ROOT / "bench"] == []
    assert [str(path.relative_to(ROOT)) for path in scripts if "sys.path" in path.read_text()] == []
    launching = re.compile(r"recipe import train\b|\"train\", str\(config")  # recipe.train, or `marl train CONFIG`
    assert [str(path.relative_to(ROOT)) for path in scripts if launching.search(path.read_text())] == []
    assert launching.search(harness.read_text())
    readme = (ROOT / "bench" / "README.md").read_text()
    unnamed = [path for path in scripts if f"`{path.relative_to(ROOT / 'bench')}`" not in readme]
    assert [str(path.relative_to(ROOT)) for path in unnamed] == []
    assert not re.search(r"^\s*(from|import) bench\b", "".join(
        path.read_text() for path in (ROOT / "tests").rglob("*.py")), re.M)  # tests import no benchmark

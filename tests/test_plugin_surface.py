"""The plugin surface is declared once (hooks.HOOKS): the docs show exactly it, the engine reads optional hooks only
through it, a config asks only for the hooks it uses, and one broken installed plugin breaks only runs that name it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np
import pytest
from pydantic import BaseModel

from marl_pipeline.config import ConfigError, parse_config
from marl_pipeline.environment import ActionResult, available_environments, get_environment_class, register_environment
from marl_pipeline.hooks import HOOKS, hooks_of

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_table_is_the_hook_table() -> None:
    page = (ROOT / "docs" / "environments.md").read_text()
    table = page[page.index("<!-- hooks -->"):page.index("<!-- /hooks -->")]
    documented = [match.replace("\\|", "|") for match in re.findall(r"^\| `(.+?)` \|", table, re.M)]
    assert documented == [hook.signature for hook in HOOKS]


def test_the_engine_reads_optional_hooks_only_through_hooks_of() -> None:
    names = "|".join(hook.name for hook in HOOKS)
    pattern = re.compile(rf"""(getattr|hasattr)\([^)]*["']({names})["']""")
    found = [f"{path.relative_to(ROOT)}: {match.group(0)}" for path in (ROOT / "marl_pipeline").rglob("*.py")
             if path.name != "hooks.py" for match in pattern.finditer(path.read_text())]
    assert found == []


class _Options(BaseModel):
    pass


@register_environment
class _Minimal:
    """Only what every run needs: no tokenizer corpus, no warm-up, no evaluation."""

    name = "minimal_for_test"
    turn_order = ("solver",)
    Options = _Options

    def __init__(self, options: _Options) -> None:
        self.options = options

    def sample_tasks(self, rng: np.random.Generator, count: int) -> list[dict]:
        return [{"id": str(i)} for i in range(count)]

    def render_prompt(self, role, task, transcript) -> str:
        return "1+1="

    def execute(self, task, transcript) -> list[ActionResult]:
        return [ActionResult("ok", True) for _ in transcript]

    def score(self, task, transcript, results) -> dict[str, float]:
        return {"solver": 1.0}


def _config(tmp_path: Path, **agent) -> dict:
    return {"run": "t", "store": str(tmp_path), "environment": {"name": "minimal_for_test"},
            "agents": {"solver": {"model": str(tmp_path / "model"), "warmup": {"steps": 0}, **agent}}}


def test_a_config_asks_only_for_the_hooks_it_uses(tmp_path: Path) -> None:
    parse_config(_config(tmp_path))  # a model directory, no warm-up, no evaluation: the four methods suffice
    with pytest.raises(ConfigError, match=r"lacks what this config needs: warmup_examples \(an agent with warmup"):
        parse_config(_config(tmp_path, warmup={"steps": 10}))
    with pytest.raises(ConfigError, match=r"text_corpus \(an agent on builtin:tiny\)"):
        parse_config(_config(tmp_path, model="builtin:tiny"))
    with pytest.raises(ConfigError, match=r"evaluation_cases \(evaluation.every\), evaluate .*answer_of"):
        parse_config({**_config(tmp_path), "evaluation": {"every": 5}})
    hooks = hooks_of(_Minimal(_Options()))
    assert (hooks.observe, hooks.uses_actions, hooks.evaluated, hooks.team_reward_weight) == (None, False, False, 0.0)


def test_a_broken_installed_plugin_breaks_only_the_runs_that_name_it(tmp_path: Path, monkeypatch) -> None:
    # A real installed distribution (a .dist-info directory on sys.path) whose plugin module fails to import.
    info = tmp_path / "broken_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[marl_pipeline.environments]\nbroken = broken_plugin_module:Broken\n")
    (tmp_path / "broken_plugin_module.py").write_text("raise ImportError('needs a package that is not installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "arithmetic_check" in available_environments() and "broken" not in available_environments()
    assert get_environment_class("arithmetic_check").name == "arithmetic_check"
    with pytest.raises(KeyError, match=r"'broken' .*fails to load: ImportError: needs a package that is not installed"):
        get_environment_class("broken")
    sys.modules.pop("broken_plugin_module", None)


def test_a_role_named_team_is_refused(tmp_path: Path) -> None:
    """``team`` is the name the team's held-out evaluation is stored under (stages/team.py)."""

    @register_environment
    class _Team(_Minimal):
        name = "team_role_for_test"
        turn_order = ("solver", "team")

    data = _config(tmp_path)
    data["environment"] = {"name": "team_role_for_test"}
    data["agents"]["team"] = dict(data["agents"]["solver"])
    with pytest.raises(ConfigError, match="has a role named 'team', the name the team's held-out evaluation"):
        parse_config(data)


class _Relay:
    """Two roles; with ``next_role``, the game it plays ends when a reply says "stop"."""

    name = "relay_turns"
    turn_order = ("a", "b", "a")


class _Game(_Relay):
    max_turns = 5

    def next_role(self, task, transcript):
        if transcript and transcript[-1].text == "stop":
            return None
        return task["next"] if transcript else "a"


def test_whose_turn_is_one_rule_fixed_order_or_the_games_cut_at_max_turns() -> None:
    from marl_pipeline.environment import Turn
    from marl_pipeline.stages.rollout import next_turn

    fixed, transcript = _Relay(), []
    while (role := next_turn(fixed, {}, transcript)) is not None:
        transcript.append(Turn(role, "x"))
    assert [turn.role for turn in transcript] == ["a", "b", "a"] and hooks_of(fixed).max_turns == 3
    game, played = _Game(), []
    while (role := next_turn(game, {"next": "b"}, played)) is not None:
        played.append(Turn(role, "go"))
    assert [turn.role for turn in played] == ["a", "b", "b", "b", "b"]  # cut at max_turns, not turn_order's 3
    assert next_turn(game, {"next": "b"}, [Turn("a", "stop")]) is None  # the game ended it
    with pytest.raises(ValueError, match=r"_Game.next_role named 'c' after 1 turns; the roles are \['a', 'b'\]"):
        next_turn(game, {"next": "c"}, [Turn("a", "go")])


def test_a_game_without_a_turn_to_cut_at_is_refused(tmp_path: Path) -> None:
    class Endless(_Game):
        name = "endless_turns"
        max_turns = 0
        Options = BaseModel

        def sample_tasks(self, rng, count): ...
        def render_prompt(self, role, task, transcript): ...
        def execute(self, task, transcript): ...
        def score(self, task, transcript, results): ...

    register_environment(Endless)
    data = {"run": "r", "store": str(tmp_path), "environment": {"name": "endless_turns"},
            "agents": {"a": {"warmup": {"steps": 0}}, "b": {"warmup": {"steps": 0}}}}
    with pytest.raises(ConfigError, match="decides its turns \\(next_role\\) and cuts an episode at max_turns 0"):
        parse_config(data)

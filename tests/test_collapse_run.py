"""Collapse caught as it happens, and stopped on (issues 31.2 and 72.6), on real launches (Ray, vLLM, torch) of a
plugin with no evaluation hooks. A checker paid only for catching the solver's mistakes earns nothing for "yes" and
collapses onto "no", right only where the solver erred: the base rate taken, the rest left. With
``health.on_collapse: stop`` the launch ends after the step where that shows, its versions committed and the launch
left to resume. The same plugin paid for a right verdict learns; nothing is reported, and nothing stops it. Both
start from the demo's warm-up (docs/ARCHITECTURE.md, "Dagster", on the ``health`` asset). tests/test_health.py has
the rule by hand, with the answers that earn the best reward (convergence) it does not stop on."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict

from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
from marl_pipeline.cluster import warm_actors
from marl_pipeline.config import HealthConfig, parse_config
from marl_pipeline.environment import build_environment, register_environment
from marl_pipeline.hooks import hooks_of
from marl_pipeline.run.events import CollapseStopped, RunFinished, StepFinished
from marl_pipeline.run.launches import run_overview
from marl_pipeline.run.recipe import train
from marl_pipeline.stages.health import COLLAPSING, collapse_warnings, recent_health
from marl_pipeline.store import ExperienceStore
from tests.conftest import small_config_data

pytestmark = pytest.mark.launch
SHARES_WARM_ACTORS = True  # its launches take the engines and trainers the module before kept (conftest)

STEPS = 12


class CheckerPaid:
    """Tests-only plugin written as the issue's was: the demo's tasks, prompts and warm-up, and no evaluation hooks
    (it delegates to ``arithmetic_check`` rather than inheriting them). ``paid_for``: ``right``, the checker's reward
    is whether its verdict is right; ``catch``, whether it said "no" to a wrong answer (a reward bug: a right "yes"
    earns nothing)."""

    name = "checker_paid"
    turn_order = ("solver", "verifier")

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        paid_for: Literal["right", "catch"]

    def __init__(self, options: Options) -> None:
        self.paid_for = options.paid_for
        self.demo = ArithmeticCheck(ArithmeticOptions(warmup_accuracy=1.0, warmup_known_share=0.5))

    def sample_tasks(self, rng, count):
        return self.demo.sample_tasks(rng, count)

    def render_prompt(self, role, task, transcript):
        return self.demo.render_prompt(role, task, transcript)

    def execute(self, task, transcript):
        return self.demo.execute(task, transcript)

    def score(self, task, transcript, results):
        caught = results[1].info["verdict"] == "no" and not results[0].success
        verdict = caught if self.paid_for == "catch" else results[1].success
        return {"solver": float(results[0].success), "verifier": float(verdict)}

    def text_corpus(self, rng, count):
        return self.demo.text_corpus(rng, count)

    def warmup_examples(self, role, rng, count):
        return self.demo.warmup_examples(role, rng, count)


register_environment(CheckerPaid)


def _config_data(demo_config_data: dict, store: Path, paid_for: str) -> dict:
    data = small_config_data(demo_config_data, store, steps=STEPS, samples_per_prompt=8)
    data["environment"] = {"name": CheckerPaid.name, "options": {"paid_for": paid_for}}
    data["health"] = {"on_collapse": "stop"}
    for agent in data["agents"].values():  # the demo's warm-up: with the suite's short one, a checker paid for right
        agent["warmup"] = {"steps": 1200, "lr": 0.001}  # verdicts could not yet judge and collapsed onto "no" too
    return data


@pytest.fixture(scope="module")
def warmed_up(local_ray, demo_config_data: dict, tmp_path_factory) -> dict[str, str]:
    """Each agent's version 0 after the demo's warm-up, made once for both launches: the warm-up does not depend on
    what the checker is paid for, and it was half of each launch."""
    from marl_pipeline.bootstrap.policies import prepare_base_policies

    config = parse_config(_config_data(demo_config_data, tmp_path_factory.mktemp("warmed") / "store", "right"))
    store = ExperienceStore(config.store)
    env = build_environment(CheckerPaid.name, {"paid_for": "right"})
    return {policy.agent: str(policy.path) for policy in prepare_base_policies(config, env, store, on_ray=True)}


def _launch(demo_config_data: dict, store: Path, paid_for: str, warmed_up: dict[str, str]) -> list:
    data = _config_data(demo_config_data, store, paid_for)
    for name, agent in data["agents"].items():  # from the warm-up made once: as a local model, not warmed up again
        agent.update(model=warmed_up[name], warmup={"steps": 0})
    config = parse_config(data)
    assert not hooks_of(build_environment(CheckerPaid.name, {"paid_for": paid_for})).evaluated
    return list(train(config))


@pytest.mark.parametrize("paid_for", ["catch", "right"], ids=["paid-for-catching", "paid-for-right"])
def test_a_checker_collapsing_onto_no_is_stopped_after_the_step_it_shows_and_a_learning_one_is_not(
        local_ray, warmed_up, demo_config_data, tmp_path: Path, paid_for: str) -> None:
    events = _launch(demo_config_data, tmp_path / "store", paid_for, warmed_up)
    store, settings = ExperienceStore(tmp_path / "store"), HealthConfig(on_collapse="stop")
    steps = [event for event in events if isinstance(event, StepFinished)]
    for event in steps:  # what each step reported is what its stored signals say, read back as any reader would
        assert event.warnings == collapse_warnings(
            recent_health(store, "demo", event.step, max(settings.steps, settings.window)), settings)
    shares = [event.health["verifier"]["top_answer_share"] for event in steps]
    if paid_for == "right":
        assert [event.step for event in steps] == list(range(STEPS)) and isinstance(events[-1], RunFinished)
        assert all(not event.warnings for event in steps), [event.warnings for event in steps]
        # Its share may touch the threshold for a step, never for `steps` in a row (the rule it is not warned by)
        above = [share > settings.top_answer_share for share in shares]
        assert not any(all(above[i:i + settings.steps]) for i in range(len(shares) - settings.steps + 1)), shares
        assert run_overview(store, "demo").state == "finished"
        return
    stopped = events[-1]
    assert isinstance(stopped, CollapseStopped) and stopped.agents == ["verifier"], shares  # never the solver
    # The launch ended after the first step whose health shows the collapse, as that step's warnings say it
    assert [event.step for event in steps] == list(range(stopped.step + 1)) and stopped.step < STEPS - 1
    assert not any(COLLAPSING in warning for event in steps[:-1] for warning in event.warnings)
    assert [warning for warning in steps[-1].warnings if COLLAPSING in warning] == stopped.warnings
    (collapsing,) = stopped.warnings
    window = shares[stopped.step - settings.steps + 1:] if "on average" not in collapsing else shares[-settings.window:]
    assert min(window) > (settings.top_answer_share if "on average" not in collapsing else 0.5)
    earned = [event.health["verifier"]["top_answer_reward"] for event in steps[-len(window):]]
    best = [event.health["verifier"]["reward_max"] for event in steps[-len(window):]]
    assert sum(best) / len(best) - sum(earned) / len(earned) > settings.converged_margin  # the reward "no" leaves
    assert f"that response earns {sum(earned) / len(earned):.2f}" in collapsing
    # Its versions are committed, and the launch is left unfinished for a relaunch to resume from them
    assert {agent: store.policy_versions("demo", agent)[-1] for agent in ("solver", "verifier")} == {
        "solver": stopped.step + 1, "verifier": stopped.step + 1}
    assert run_overview(store, "demo").state == "unfinished"
    assert "--set agents.verifier.algorithm.advantage.type=dr_grpo" in stopped.reason()
    # A clean stop, not a failure: its engines and trainers are kept for the next launch (``ray.keep_actors``)
    assert warm_actors.idle_count() == 4
    assert f"resumes from version {stopped.step + 1}" in stopped.reason()

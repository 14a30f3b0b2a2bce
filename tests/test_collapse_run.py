"""Collapse caught as it happens (issue 31.2), on real launches (Ray, vLLM, torch) of a plugin with no evaluation
hooks: a checker paid for saying "yes" whatever it is shown collapses onto "yes", and the step's warnings name it
with its figures while the run goes on; the same plugin paid for a right verdict learns, and nothing is reported.
Both start from the demo's warm-up (docs/ARCHITECTURE.md, "Dagster", on the ``health`` asset)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from environments.arithmetic import ArithmeticCheck, ArithmeticOptions
from marl_pipeline.config import HealthConfig, parse_config
from marl_pipeline.environment import build_environment, register_environment
from marl_pipeline.hooks import hooks_of
from marl_pipeline.run.events import StepFinished
from marl_pipeline.run.recipe import train
from marl_pipeline.stages.health import collapse_warnings, recent_health
from marl_pipeline.store import ExperienceStore
from tests.conftest import small_config_data

pytestmark = pytest.mark.launch

STEPS = 12  # the checker paid for "yes" passed 0.9 at steps 6-8 here, the one paid for right at one step at most


class CheckerPaid:
    """Tests-only plugin written as the issue's was: the demo's tasks, prompts and warm-up, and no evaluation hooks
    (it delegates to ``arithmetic_check`` rather than inheriting them). ``paid_for_yes``: the checker's reward is
    whether it said "yes" (a reward bug); otherwise whether its verdict is right."""

    name = "checker_paid"
    turn_order = ("solver", "verifier")

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        paid_for_yes: bool

    def __init__(self, options: Options) -> None:
        self.paid_for_yes = options.paid_for_yes
        self.demo = ArithmeticCheck(ArithmeticOptions(warmup_accuracy=1.0, warmup_known_share=0.5))

    def sample_tasks(self, rng, count):
        return self.demo.sample_tasks(rng, count)

    def render_prompt(self, role, task, transcript):
        return self.demo.render_prompt(role, task, transcript)

    def execute(self, task, transcript):
        return self.demo.execute(task, transcript)

    def score(self, task, transcript, results):
        verdict = results[1].info["verdict"] == "yes" if self.paid_for_yes else results[1].success
        return {"solver": float(results[0].success), "verifier": float(verdict)}

    def text_corpus(self, rng, count):
        return self.demo.text_corpus(rng, count)

    def warmup_examples(self, role, rng, count):
        return self.demo.warmup_examples(role, rng, count)


register_environment(CheckerPaid)


def _config_data(demo_config_data: dict, store: Path, paid_for_yes: bool) -> dict:
    data = small_config_data(demo_config_data, store, steps=STEPS, samples_per_prompt=8)
    data["environment"] = {"name": CheckerPaid.name, "options": {"paid_for_yes": paid_for_yes}}
    for agent in data["agents"].values():  # the demo's warm-up: with the suite's short one, a checker paid for right
        agent["warmup"] = {"steps": 1200, "lr": 0.001}  # verdicts could not yet judge and collapsed onto "no" too
    return data


@pytest.fixture(scope="module")
def warmed_up(local_ray, demo_config_data: dict, tmp_path_factory) -> dict[str, str]:
    """Each agent's version 0 after the demo's warm-up, made once for both launches: the warm-up does not depend on
    what the checker is paid for, and it was half of each launch."""
    from marl_pipeline.bootstrap.policies import prepare_base_policies

    config = parse_config(_config_data(demo_config_data, tmp_path_factory.mktemp("warmed") / "store", False))
    store = ExperienceStore(config.store)
    env = build_environment(CheckerPaid.name, {"paid_for_yes": False})
    return {policy.agent: str(policy.path) for policy in prepare_base_policies(config, env, store, on_ray=True)}


def _launch(demo_config_data: dict, store: Path, paid_for_yes: bool,
            warmed_up: dict[str, str]) -> tuple[list[StepFinished], ExperienceStore]:
    data = _config_data(demo_config_data, store, paid_for_yes)
    for name, agent in data["agents"].items():  # from the warm-up made once: as a local model, not warmed up again
        agent.update(model=warmed_up[name], warmup={"steps": 0})
    config = parse_config(data)
    assert not hooks_of(build_environment(CheckerPaid.name, {"paid_for_yes": paid_for_yes})).evaluated
    steps = [event for event in train(config) if isinstance(event, StepFinished)]
    assert [event.step for event in steps] == list(range(STEPS))  # a warning never stops the run
    return steps, ExperienceStore(config.store)


@pytest.mark.parametrize("paid_for_yes", [True, False], ids=["paid-for-yes", "paid-for-right"])
def test_a_checker_collapsing_onto_yes_is_reported_as_it_happens_and_a_learning_one_is_not(
        local_ray, warmed_up, demo_config_data, tmp_path: Path, paid_for_yes: bool) -> None:
    steps, store = _launch(demo_config_data, tmp_path / "store", paid_for_yes, warmed_up)
    settings = HealthConfig()
    for event in steps:  # what each step reported is what its stored signals say, read back as any reader would
        assert event.warnings == collapse_warnings(
            recent_health(store, "demo", event.step, max(settings.steps, settings.window)), settings)
    shares = [event.health["verifier"]["top_answer_share"] for event in steps]
    if not paid_for_yes:
        assert all(not event.warnings for event in steps), [event.warnings for event in steps]
        # Its share may touch the threshold for a step, never for `steps` in a row (the rule it is not warned by)
        above = [share > settings.top_answer_share for share in shares]
        assert not any(all(above[i:i + settings.steps]) for i in range(len(shares) - settings.steps + 1)), shares
        return
    warned = [event for event in steps if event.warnings]
    assert warned, shares
    assert all(warning.startswith("verifier ") for event in warned for warning in event.warnings)  # never the solver
    # The first step whose last `steps` stored steps show it in a row (every step's warnings are checked above; the
    # windowed rule, a mean over `window` steps, may speak first, tested by hand in tests/test_health.py).
    first = next(event for event in warned if any(
        "may be collapsing" in warning and "on average" not in warning for warning in event.warnings))
    (collapsing,) = [warning for warning in first.warnings if warning.startswith("verifier may be collapsing")]
    window = shares[first.step - settings.steps + 1:first.step + 1]
    assert min(window) > settings.top_answer_share
    figures = ", ".join(f"{share:.2f}" for share in window)
    assert (f"the same response is {figures} of its responses in one turn over steps "
            f"{first.step - settings.steps + 1}-{first.step}") in collapsing

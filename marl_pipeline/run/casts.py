"""The team evaluated with any stored policy version in any role: a cast. What a team's training bought shows only
beside other casts of the same roles (AT-GRPO's check: role policies 97%, the same policies with the roles swapped
6%):

- ``trained``: each role its own agent's policy at the version evaluated;
- ``swapped``: each role the next agent's policy (a rotation of the roles; for two agents, the two exchanged), where
  each agent plays one role;
- ``<agent>@0``: that agent's version 0 beside its teammates' version evaluated: what its own training contributed.

Beside each, the answering role alone at the same number of samples (``first_sample``, ``majority_vote``): the
single-agent baseline. A cast is played as the held-out evaluation plays the team (stages/team.py: the answering
role's held-out cases, ``evaluation.team_samples`` episodes each, seeded by turn and episode only), on engines
serving the cast's policies, and its figures are kept in the run's ``casts.json`` record, which ``marl inspect``
and the ``team_casts`` asset show.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from marl_pipeline.cluster import warm_actors
from marl_pipeline.cluster.spawn import start_engines
from marl_pipeline.config import ExperimentConfig
from marl_pipeline.environment import Environment
from marl_pipeline.hooks import hooks_of
from marl_pipeline.stages.evaluation import EvaluationSettings, is_evaluated, team_metrics
from marl_pipeline.stages.team import evaluate_team
from marl_pipeline.store import ExperienceStore

RECORD = "casts.json"
_PART = re.compile(r"^([A-Za-z0-9_.-]+)=([A-Za-z0-9_.-]+)@(\d+)$")


@dataclass(frozen=True)
class Cast:
    """Which stored policy plays each role: role -> (agent whose policy, its version)."""

    name: str
    roles: dict[str, tuple[str, int]]

    def describe(self) -> str:
        return ", ".join(f"{role}={agent}@{version}" for role, (agent, version) in self.roles.items())


def standard_casts(players: dict[str, str], version: int) -> list[Cast]:
    """``trained``, ``swapped`` (with two agents or more, each playing one role) and each ``<agent>@0``, at
    ``version``; ``players``: the agent playing each role (``ExperimentConfig.role_agents``)."""
    casts = [Cast("trained", {role: (agent, version) for role, agent in players.items()})]
    agents = list(dict.fromkeys(players.values()))
    if 1 < len(agents) == len(players):
        casts.append(Cast("swapped", {role: (agents[(agents.index(agent) + 1) % len(agents)], version)
                                      for role, agent in players.items()}))
    if version > 0:
        casts += [Cast(f"{own}@0", {role: (agent, 0 if agent == own else version) for role, agent in players.items()})
                  for own in agents]
    return casts


def parse_cast(text: str, players: dict[str, str]) -> Cast:
    """``NAME:ROLE=AGENT@VERSION,...`` (every role once; the name optional) as a cast; ``players``: the agent
    playing each role.

    Raises:
        ValueError: naming what is wrong.
    """
    name, _, parts = text.rpartition(":")
    roles = {}
    for part in parts.split(","):
        found = _PART.match(part.strip())
        if found is None:
            raise ValueError(f"cast {text!r}: {part.strip()!r} is not ROLE=AGENT@VERSION (solver=verifier@100)")
        role, agent, version = found.group(1), found.group(2), int(found.group(3))
        if role not in players:
            raise ValueError(f"cast {text!r}: {role!r} is no role of the run ({', '.join(players)})")
        if agent not in players.values():
            raise ValueError(f"cast {text!r}: {agent!r} is no agent of the run "
                             f"({', '.join(dict.fromkeys(players.values()))})")
        if role in roles:
            raise ValueError(f"cast {text!r}: role {role!r} is cast twice")
        roles[role] = (agent, version)
    if missing := [role for role in players if role not in roles]:
        raise ValueError(f"cast {text!r}: roles {missing} are not cast (every role needs a policy)")
    for role, agent in players.items():  # a shared policy's roles are served by its one engine
        if (other := next(r for r, a in players.items() if a == agent)) != role and roles[other] != roles[role]:
            raise ValueError(f"cast {text!r}: roles {other!r} and {role!r} share agent {agent!r}'s engine, so "
                             f"they take one policy: {roles[other][0]}@{roles[other][1]} or "
                             f"{roles[role][0]}@{roles[role][1]}")
    return Cast(name or parts, {role: roles[role] for role in players})


def chosen_casts(texts: list[str], players: dict[str, str], version: int) -> list[Cast]:
    """The user's casts (:func:`parse_cast` each), or without any the :func:`standard_casts` at ``version``: what
    ``marl evaluate`` and the ``team_casts`` asset play.

    Raises:
        ValueError: a cast is malformed (naming it).
    """
    return [parse_cast(text, players) for text in texts] or standard_casts(players, version)


def evaluate_cast(config: ExperimentConfig, env: Environment, store: ExperienceStore, cast: Cast) -> dict:
    """Play the team's held-out episodes with ``cast``'s policies (on engines started for it, on the Ray the caller
    initialised) and keep its figures in the run's :data:`RECORD`; returns the record's entry: ``roles``,
    ``metrics`` (``team_answer``, ``first_sample``, ``majority_vote``, ``any_sample``), ``cases`` and ``at``.

    Raises:
        ValueError: the plugin has no team to measure, a policy is not stored, or a cast moves a policy with named
            adapters to another role (they serve their own agent's turns).
    """
    settings = EvaluationSettings.from_config(config)
    if not is_evaluated(env) or hooks_of(env).team_choice is None or not settings.team_samples:
        raise ValueError(f"environment {config.environment.name!r} has no team to measure: a cast needs "
                         f"evaluation_cases, evaluate and team_choice, and evaluation.team_samples above 0")
    for role, (agent, version) in cast.roles.items():
        store.require_policy(config.run, agent, version)
        if agent != role and (config.agents[agent].turn_adapters or role in config.turn_adapters()):
            raise ValueError(f"cast {cast.name!r}: {agent}'s policy in role {role} with named adapters "
                             f"(turn_adapters), which serve their own agent's turns only")
    players = config.role_agents()  # engines are the agents' (a shared policy's roles share one)
    slots = {players[role]: policy for role, policy in cast.roles.items()}
    engines = start_engines(config, store, {agent: version for agent, (_, version) in slots.items()},
                            sources={agent: source for agent, (source, _) in slots.items()})
    try:
        rows = evaluate_team(env, {role: engines[players[role]] for role in cast.roles}, settings,
                             {role: version for role, (_, version) in cast.roles.items()}).to_pylist()
    finally:
        for engine in engines.values():
            warm_actors.release(engine, config.ray.keep_actors)
    entry = {"roles": {role: {"agent": agent, "version": version} for role, (agent, version) in cast.roles.items()},
             "metrics": team_metrics(env, rows), "cases": len(rows), "at": time.time()}
    record = store.read_record(config.run, RECORD) or {}
    store.write_record(config.run, RECORD, {**record, cast.name: entry})
    return entry


def stored_casts(store: ExperienceStore, run: str) -> dict[str, dict]:
    """The run's evaluated casts, by name, as :func:`evaluate_cast` kept them (empty: none)."""
    return store.read_record(run, RECORD) or {}

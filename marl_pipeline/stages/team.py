"""The team measured as a team, on held-out cases: what the agents achieve together against the answering role alone.

The answering role gives the team's answer: the first speaker, or the role the plugin names (``answering_role``, the
last step of a task the roles split). Each of its held-out cases (``evaluation_cases``, the same ones its own
evaluation answers greedily) is played from the task as ``team_samples`` sampled episodes of the whole workflow,
every agent at one policy version, seeded by (run seed, turn, episode) only, so versions compare. The plugin's
``team_choice`` says which episode's answer the team returns (for a solver and a verifier: the solver's answer the
verifier's verdicts choose). Beside it, from the same episodes, what the answering role achieves alone: its first
sample, and the majority of its answers (the same n); and ``any_sample``, the share of cases where one of the n is
right, the most any choice could reach. Every score is the plugin's own: the headline metric of the answering role's
``evaluate`` over the chosen responses (stages/evaluation.py: ``team_metrics``).

Stored as rows of the version's evaluations partition with agent ``team`` (``environment.TEAM``): one per case, its
episodes as the transcript (JSON: a list of episodes, each a list of turns), the chosen response as the response;
``team_metrics`` recomputes every figure from those rows and the plugin alone.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pyarrow as pa
import ray

from marl_pipeline.config.agent import turn_adapter
from marl_pipeline.environment import TEAM, Environment, Turn
from marl_pipeline.hooks import hooks_of
from marl_pipeline.inference.engine import GenerationRequest, PromptTooLong
from marl_pipeline.stages.evaluation import (
    EVALUATION_STREAM,
    EvaluationSettings,
    answer_text,
    chosen_episode,
    evaluation_cases,
    is_evaluated,
)
from marl_pipeline.stages.rollout import engine_chat_session, next_turn, observe_reply
from marl_pipeline.store.schema import EVALUATIONS, with_agent

TEAM_STREAM = 0x7EA3
"""The team's episodes' seed word, after the evaluation stream's."""


def is_team_evaluated(env: Environment, settings: EvaluationSettings) -> bool:
    """Whether a version's evaluation measures the team too: the plugin has ``team_choice`` and
    ``evaluation.team_samples`` is not 0."""
    return is_evaluated(env) and hooks_of(env).team_choice is not None and settings.team_samples > 0


def evaluate_team(env: Environment, engines: dict[str, ray.actor.ActorHandle], settings: EvaluationSettings,
                  versions: dict[str, int] | None = None) -> pa.Table:
    """The team's rows: each held-out case of the answering role played ``settings.team_samples`` times by the agents
    ``engines`` serve (each at the same version; with ``versions``, each role at its own, a cast's: run/casts.py),
    turn by turn, every episode's next turn in one batch per agent. A turn whose prompt the engine's context cannot
    hold gets an empty reply and the episode goes on (the case's status ``prompt_too_long``, which turns in
    ``error``). The rows' ``policy_version`` is the answering role's."""
    answering = hooks_of(env).answering_role
    cases = evaluation_cases(env, answering, settings)
    n = settings.team_samples
    episodes: list[list[Turn]] = [[] for _ in range(len(cases) * n)]  # episode e plays case e // n
    chats = engine_chat_session(env, engines)
    served: dict[str, set[int]] = {}
    refused: dict[int, list[str]] = {}  # per case: its turns whose prompt the engine's context could not hold
    for turn in range(hooks_of(env).max_turns):
        seeds = np.random.SeedSequence([settings.seed, EVALUATION_STREAM, TEAM_STREAM, turn]).generate_state(
            len(episodes))
        speakers: dict[str, list[int]] = {}  # per role: the episodes it speaks next in
        for e, episode in enumerate(episodes):
            if len(episode) == turn and (role := next_turn(env, cases[e // n].task, episode)) is not None:
                speakers.setdefault(role, []).append(e)
        if not speakers:
            break
        for role, playing in speakers.items():
            requests = [GenerationRequest(
                chats.request(e, role, turn, env.render_prompt(role, cases[e // n].task, episodes[e])),
                int(seeds[e]), settings.max_new_tokens[role], settings.temperature[role],
                turn_adapter(settings.turn_adapters, role, [earlier.role for earlier in episodes[e]]))
                for e in playing]
            version, completions = ray.get(engines[role].generate.remote(requests, refused_alone=True))
            served.setdefault(role, set()).add(version)
            for e, completion in zip(playing, completions):
                if isinstance(completion, PromptTooLong):  # over the engine's context: an empty reply, and on
                    refused.setdefault(e // n, []).append(f"episode {e % n}, turn {turn} ({role}): {completion}")
                    text, ids = "", []
                else:
                    text, ids = completion.text, completion.response_ids
                chats.record(e, role, text, ids)
                # a reply that fails leaves the turn without one and the episode goes on, as in rollout
                observation, _ = observe_reply(env, role, cases[e // n].task, [*episodes[e], Turn(role, text)])
                episodes[e].append(Turn(role, text, observation))
    # every engine serves its one version throughout: the version evaluated, or each role's in a cast
    wanted = versions or dict.fromkeys(served, min(set().union(*served.values()), default=None))
    if any(found != {wanted[role]} for role, found in served.items()):
        what = "the cast's versions" if versions else "one version"
        shown = {role: sorted(found) for role, found in served.items()}
        raise RuntimeError(f"the team's evaluation engines did not each serve {what} throughout: {shown}")
    version = wanted.get(answering)
    rows = []
    for c, case in enumerate(cases):
        played = episodes[c * n:(c + 1) * n]
        response = answer_text(answering, played[chosen_episode(env, case, played)])
        rows.append({
            "policy_version": version, "case": c, "task_id": str(case.task["id"]), "task": json.dumps(case.task),
            "transcript": json.dumps([[asdict(turn) for turn in episode] for episode in played]),
            "label": case.label, "prompt_text": None, "response_text": response,
            "answer": env.answer_of(answering, response),  # type: ignore[attr-defined]
            "metrics": None, "status": "prompt_too_long" if c in refused else "ok",
            "error": "; ".join(refused[c]) if c in refused else None, "agent": TEAM})
    return pa.Table.from_pylist(rows, schema=with_agent(EVALUATIONS))

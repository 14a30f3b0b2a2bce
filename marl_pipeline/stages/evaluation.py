"""Held-out evaluation: each agent's greedy answers to its own held-out cases, and the metrics of its skill.

Learning is measured per agent, not read off the reward: a verifier that always says "yes" earns exactly
the solver's accuracy while its skill (telling right answers from wrong ones) falls. The plugin's
``evaluation_cases`` give each agent its own cases (a verifier is shown right and wrong answers whatever
the solver says) and its ``evaluate`` computes the agent's metrics; every agent also gets the entropy of
its answers and the share of its most frequent one, which expose a collapsed policy.

Cases are drawn from a seed stream training never draws from (training's tasks come from
``[seed, step, micro_batch]``), the same cases for every policy version so versions compare; decoding is
greedy, so an evaluation is a function of the weights alone. A case rendered as chat messages is tokenized
the way the rollout stage tokenizes an agent's first turn (its transcript is the plugin's, not the engine's, so
there are no earlier ids to extend); a case of several turns then extends the agent's own ids turn by turn, as
in rollout.
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np
import pyarrow as pa
import ray

from marl_pipeline.config import ExperimentConfig
from marl_pipeline.config.agent import adapter_of_turn
from marl_pipeline.environment import TEAM, Environment, EvaluationCase, Turn, accepted_majority
from marl_pipeline.hooks import hooks_of
from marl_pipeline.inference.engine import Completion, GenerationRequest, PromptTooLong
from marl_pipeline.stages.rollout import engine_chat_session
from marl_pipeline.store.schema import EVALUATIONS, with_agent

EVALUATION_STREAM = 0x5EED_E7A1
"""The fourth word of the evaluation seed (training's task seeds have three words)."""
COLLAPSE_SHARE = 0.95
"""An agent whose most frequent answer is above this share of its held-out answers, on cases whose right
answers differ, has collapsed."""


@dataclass(frozen=True)
class EvaluationSettings:
    """The slice of the config the evaluation needs."""

    seed: int
    cases_per_agent: int
    max_new_tokens: dict[str, int]
    """Per role, the longest answer (``evaluation.max_new_tokens``, else its agent's ``algorithm.max_new_tokens``)."""
    turn_adapters: dict[str, dict[str, list[int]]] = field(default_factory=dict)
    """Per agent, its ``turn_adapters``: named adapters and the own turns they serve."""
    team_samples: int = 0
    """Episodes per case when the team is measured (stages/team.py); 0: it is not."""
    temperature: dict[str, float] = field(default_factory=dict)
    """Per role, the temperature of the team's episodes: they are sampled as training samples them."""

    @classmethod
    def from_config(cls, config: ExperimentConfig) -> EvaluationSettings:
        evaluation = config.evaluation
        team_samples = evaluation.team_samples
        algorithms = {role: config.algorithm_of(agent) for role, agent in config.role_agents().items()}
        return cls(config.seed, evaluation.cases_per_agent,
                   {role: evaluation.max_new_tokens or a.max_new_tokens for role, a in algorithms.items()},
                   config.turn_adapters(),
                   config.pipeline.samples_per_prompt if team_samples is None else team_samples,
                   {role: a.temperature for role, a in algorithms.items()})


def is_evaluated(env: Environment) -> bool:
    """Whether the plugin measures its agents on held-out cases (``evaluation_cases`` + ``evaluate``)."""
    return hooks_of(env).evaluated


def evaluation_cases(env: Environment, role: str, settings: EvaluationSettings) -> list[EvaluationCase]:
    """``role``'s held-out cases: the same for every policy version of the run."""
    rng = np.random.default_rng([settings.seed, zlib.crc32(role.encode()), 1, EVALUATION_STREAM])
    return env.evaluation_cases(role, rng, settings.cases_per_agent)  # type: ignore[attr-defined]


def evaluate_agent(env: Environment, role: str, engine: ray.actor.ActorHandle,
                   settings: EvaluationSettings) -> pa.Table:
    """Greedy answers of the policy ``engine`` serves to ``role``'s held-out cases; one row per case. A case of
    several turns (``EvaluationCase.turns``) is played turn by turn, all cases' next turns in one batch; its stored
    transcript is everything before its last reply, its own earlier replies included. A case whose prompt the
    engine's context cannot hold ends there unanswered (status ``prompt_too_long``, an empty reply, scored as the
    plugin scores one); the other cases go on."""
    cases = evaluation_cases(env, role, settings)
    chats = engine_chat_session(env, {role: engine})
    transcripts = [list(case.transcript) for case in cases]
    served = settings.turn_adapters.get(role, {})
    last: dict[int, tuple[str | list[int], Completion | PromptTooLong]] = {}
    versions = set()
    for turn in range(max((case.turns for case in cases), default=0)):
        # a case whose prompt outgrew the engine's context ends there, unanswered
        playing = [index for index, case in enumerate(cases)
                   if turn < case.turns and (index not in last or not isinstance(last[index][1], PromptTooLong))]
        requests = [chats.request(index, role, len(transcripts[index]),
                                  env.render_prompt(role, cases[index].task, transcripts[index])) for index in playing]
        adapter = adapter_of_turn(served, turn)
        version, completions = ray.get(engine.generate.remote(
            [GenerationRequest(request, 0, settings.max_new_tokens[role], 0.0, adapter) for request in requests],
            refused_alone=True))
        versions.add(version)
        for index, request, completion in zip(playing, requests, completions):
            last[index] = (request, completion)
            if isinstance(completion, PromptTooLong):
                continue
            chats.record(index, role, completion.text, completion.response_ids)
            if turn + 1 < cases[index].turns:
                transcripts[index].append(Turn(role, completion.text))
    if len(versions) > 1:  # an evaluation engine serves one version; a sync mid-case would mix two policies
        raise RuntimeError(f"{role}'s evaluation engine changed policy version mid-evaluation: {sorted(versions)}")
    version = versions.pop() if versions else None
    rows = []
    for index, case in enumerate(cases):
        request, completion = last[index]
        refused = isinstance(completion, PromptTooLong)
        response = "" if refused else completion.text  # unanswered: scored as the plugin scores an empty reply
        rows.append({
            "policy_version": version, "case": index,
            "task_id": str(case.task["id"]), "task": json.dumps(case.task),
            "transcript": json.dumps([asdict(turn) for turn in transcripts[index]]), "label": case.label,
            "prompt_text": chats.prompt_text(role, request), "response_text": response,
            "answer": env.answer_of(role, response),  # type: ignore[attr-defined]
            "metrics": None, "status": "prompt_too_long" if refused else "ok",
            "error": f"its prompt is over max_model_len: {completion}" if refused else None,
            "agent": role})
    return pa.Table.from_pylist(rows, schema=with_agent(EVALUATIONS))


def evaluation_metrics(env: Environment, table: pa.Table) -> dict[str, dict[str, float]]:
    """Per agent: the plugin's metrics of the stored answers, plus ``answer_entropy`` (nats),
    ``top_answer_share`` and ``collapsed`` (1.0 when the top share passes ``COLLAPSE_SHARE`` although the
    right answers differ)."""
    by_agent: dict[str, list[dict]] = {}
    for row in sorted(table.to_pylist(), key=lambda r: r["case"]):  # one conversion for every agent
        by_agent.setdefault(row["agent"], []).append(row)
    metrics = {}
    for agent, rows in sorted(by_agent.items()):
        if agent == TEAM:  # the team's rows (stages/team.py): each case's episodes, the chosen answer
            metrics[agent] = team_metrics(env, rows)
            continue
        cases = [EvaluationCase(json.loads(r["task"]), [Turn(**t) for t in json.loads(r["transcript"])], r["label"])
                 for r in rows]
        figures = dict(env.evaluate(agent, cases, [r["response_text"] for r in rows]))  # type: ignore[attr-defined]
        figures.update(answer_statistics([r["answer"] for r in rows], [r["label"] for r in rows]))
        metrics[agent] = figures
    return metrics


def with_metrics(env: Environment, table: pa.Table) -> tuple[pa.Table, dict[str, dict[str, float]]]:
    """The table with each agent's metrics stored on its rows (so the store answers "how good was v" without
    the plugin: ``marl inspect``, DuckDB, the plots), and the metrics."""
    metrics = evaluation_metrics(env, table)
    column = pa.array([json.dumps(metrics[agent]) for agent in table.column("agent").to_pylist()], pa.string())
    return table.set_column(table.column_names.index("metrics"), "metrics", column), metrics


def stored_metrics(table: pa.Table) -> dict[str, dict[str, float]]:
    """Per agent, the metrics stored with an evaluations partition."""
    rows = table.select(["agent", "metrics"]).to_pylist()
    return {row["agent"]: json.loads(row["metrics"]) for row in sorted(rows, key=lambda r: r["agent"])
            if row["metrics"] is not None}


def answer_statistics(answers: list[str], labels: list[str]) -> dict[str, float]:
    """Entropy (nats) of the answer distribution, the share of the most frequent answer, and whether that share
    marks a collapse (above ``COLLAPSE_SHARE`` on cases that need more than one answer)."""
    if not answers:
        return {"answer_entropy": 0.0, "top_answer_share": 0.0, "collapsed": 0.0}
    counts = np.asarray(list(Counter(answers).values()), dtype=np.float64)
    shares = counts / counts.sum()
    top = float(shares.max())
    entropy = float(-(shares * np.log(shares)).sum())
    needs_several = len(set(labels)) > 1
    return {"answer_entropy": max(entropy, 0.0), "top_answer_share": top,
            "collapsed": float(needs_several and top > COLLAPSE_SHARE)}


def chosen_episode(env: Environment, case: EvaluationCase, episodes: list[list[Turn]]) -> int:
    """The plugin's choice among a case's episodes, checked."""
    choice = hooks_of(env).team_choice(case.task, episodes)  # type: ignore[misc]
    if not isinstance(choice, int | np.integer) or not 0 <= choice < len(episodes):
        raise ValueError(f"team_choice returned {choice!r} for task {case.task['id']!r}: expected the index of "
                         f"one of its {len(episodes)} episodes")
    return int(choice)


def answer_text(role: str, episode: list[Turn]) -> str:
    """``role``'s answer in an episode: its last turn's text."""
    return next(turn.text for turn in reversed(episode) if turn.role == role)


def team_metrics(env: Environment, rows: list[dict]) -> dict[str, float]:
    """The team's figures from its stored rows (one per case, by case): ``team_answer`` (the plugin's choice),
    ``first_sample`` and ``majority_vote`` (the answering role alone, same episodes), ``any_sample`` (a right answer
    among them), each the answering role's headline metric; then the statistics of the team's answers."""
    answering = hooks_of(env).answering_role
    cases = [EvaluationCase(json.loads(row["task"]), [], row["label"]) for row in rows]
    played = [[[Turn(**turn) for turn in episode] for episode in json.loads(row["transcript"])] for row in rows]

    def score(chosen: list[int]) -> float:
        responses = [answer_text(answering, episodes[i]) for episodes, i in zip(played, chosen)]
        return headline_metric(env.evaluate(answering, cases, responses))[1]  # type: ignore[attr-defined]

    answers = [[env.answer_of(answering, answer_text(answering, e)) for e in episodes]  # type: ignore[attr-defined]
               for episodes in played]
    everyone = [accepted_majority(case_answers, [True] * len(case_answers)) for case_answers in answers]
    figures = {
        "team_answer": score([chosen_episode(env, case, episodes) for case, episodes in zip(cases, played)]),
        "first_sample": score([0] * len(cases)),
        "majority_vote": score(everyone),
        "any_sample": float(np.mean([max(  # a case's best episode, the most any choice could reach
            headline_metric(env.evaluate(answering, [case], [answer_text(answering, e)]))[1]  # type: ignore[attr-defined]
            for e in episodes) for case, episodes in zip(cases, played)])) if cases else 0.0,
    }
    figures.update(answer_statistics([row["answer"] for row in rows], [row["label"] for row in rows]))
    return figures


def headline_metric(metrics: dict[str, float]) -> tuple[str, float]:
    """The agent's headline metric: the plugin's first one."""
    name = next(iter(metrics))
    return name, metrics[name]

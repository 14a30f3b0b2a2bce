"""Training-health signals of one step, per agent, from the step's stored partitions alone, for any plugin (no
evaluation hooks needed): what shows one agent collapsing while the team's mean reward rises.

Per agent: the share of GRPO groups whose rewards are all equal (they carry no learning signal), answer diversity
(the share of distinct responses to one prompt and of its most frequent one, averaged over the prompts of its
turns, and the share of its most frequent response over the whole step, in the turn where it is highest among the
turns asked more than one prompt), the mean
-log p of the sampled tokens (an unbiased estimate of the policy's token entropy at temperature 1), what the most
frequent response earned beside the best reward any turn earned (its base rate: whether one answer to everything
leaves reward untaken, or is simply right), response length
and the share cut at the token limit, the update's loss per token, clip fraction and engine-vs-trainer mismatch
(token-weighted over the step's micro-batches) and its gradient norm; beside them, the trainer's throughput at the
update (real tokens a second, and MFU: 6 x parameters x real tokens / seconds over the measured matmul peak,
training/flops.py). :func:`collapse_warnings` reads collapse from them (``health.*`` settings). And the groups the
agent's turns are in that are short of n finished episodes, the episodes they lack, and the episodes over-sampling
dropped (``pipeline.rollout.oversample``; the other signals leave dropped turns out).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import TYPE_CHECKING

import pyarrow as pa

from marl_pipeline.config import ExperimentConfig, HealthConfig
from marl_pipeline.stages.episodes import DROPPED
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.recent import RecentCommits
from marl_pipeline.store.schema import HEALTH, with_time

if TYPE_CHECKING:
    from marl_pipeline.training.batches import StepResult

ROLLOUT_COLUMNS = ["agent", "sample_id", "group_id", "turn", "prompt_text", "response_text", "response_ids", "logprobs",
                   "finish_reason", "status", "group_shortfall", "group_dropped", "policy_version"]
REWARD_COLUMNS = ["agent", "sample_id", "group_id", "reward"]
UPDATE_COLUMNS = ["agent", "tokens", "loss_sum", "clip_fraction", "mismatch_abs_logprob"]
HEALTH_SIGNALS = [field.name for field in HEALTH if field.name not in ("policy_version", "groups", "step_finished")]
"""The signals proper (not the row's version, group count and time), as events, logs and plots show them."""
TRAINER_SIGNALS = ("grad_norm", "trainer_tokens_per_s", "mfu")
"""The signals the trainer reports with its optimizer step: known only to the launch that stepped (a step recomputed
from the store has them null)."""
PERF_SIGNALS = ("trainer_tokens_per_s", "mfu")
"""Throughput rather than health: tracked under ``perf/``, left out of ``marl inspect``'s health table."""
COLLAPSING = "may be collapsing"
"""The sign of the warnings that ``health.on_collapse: stop`` ends a launch on: the same answer to everything while
it earns less than the agent's best turns (the base rate taken, the rest left)."""
ONE_ANSWER_PAID = "gives one answer that earns the best reward"
"""The sign of the same answer to everything where it earns (nearly) the best reward: convergence, or a reward one
answer satisfies. Warned, never stopped on; nor is "almost no learning signal", which a converged agent has too."""


def trainer_signals(result: StepResult) -> dict[str, float]:
    """An optimizer step's :data:`TRAINER_SIGNALS`, from the trainer's result."""
    return {"grad_norm": result.grad_norm, "trainer_tokens_per_s": result.tokens_per_second, "mfu": result.mfu}


def step_health(store: ExperienceStore | RecentCommits, run: str, step: int, versions: dict[str, int],
                trainer: dict[str, dict[str, float]], micro_batches: int) -> pa.Table:
    """The health table of ``step`` (one row per agent of ``versions``: the version each agent's update made), from
    its ``micro_batches`` partitions, read by key (a scan of the stage would open every committed partition's
    manifest, a cost that grows with the run), and ``trainer``: per agent stepped here, its :func:`trainer_signals`."""
    keys = [MicroBatchKey(run, step, micro_batch) for micro_batch in range(micro_batches)]

    def rows(stage: str, columns: list[str]) -> list[dict]:
        return pa.concat_tables([store.read(stage, key, columns=columns) for key in keys]).to_pylist()

    return health_table(rows("rollouts", ROLLOUT_COLUMNS), rows("rewards", REWARD_COLUMNS),
                        rows("policy_updates", UPDATE_COLUMNS), versions, trainer)


def commit_step_health(store: ExperienceStore | RecentCommits, run: str, step: int, versions: dict[str, int],
                       trainer: dict[str, dict[str, float]], micro_batches: int,
                       finished: float | None = None) -> pa.Table:
    """:func:`step_health`, committed as the ``health`` partition of the step (once: a committed one is read), with
    ``finished`` (epoch seconds; None: not known here) as every row's ``step_finished``."""
    key = MicroBatchKey(run, step, 0)
    if store.is_committed("health", key):
        return store.read("health", key)
    table = step_health(store, run, step, versions, trainer, micro_batches)
    if finished is not None:
        table = with_time(table, HEALTH.field("step_finished"), finished)
    store.commit("health", key, table)
    return table


def health_table(rollouts: list[dict], rewards: list[dict], updates: list[dict], versions: dict[str, int],
                 trainer: dict[str, dict[str, float]]) -> pa.Table:
    """The signals from the step's rows (dicts of the stored columns); see the module's docstring."""
    rows = []
    for agent, version in versions.items():
        turns = [row for row in rollouts if row["agent"] == agent]
        sampled = [row for row in turns if row.get("status") != DROPPED]
        prompts, groups = defaultdict(list), defaultdict(list)
        for row in sampled:
            prompts[row["group_id"], row["turn"]].append(row["response_text"])
        for row in rewards:
            if row["agent"] == agent:
                groups[row["group_id"]].append(row["reward"])
        tokens = sum(len(row["response_ids"]) for row in sampled)
        earned = {row["sample_id"]: row["reward"] for row in rewards
                  if row["agent"] == agent and row.get("sample_id") is not None}
        trained = [row for row in updates if row["agent"] == agent]
        trained_tokens = sum(row["tokens"] for row in trained)
        loss = sum(row["loss_sum"] or 0.0 for row in trained)
        rows.append({
            "agent": agent, "policy_version": version, "groups": len(groups),
            "zero_variance_groups": _mean([max(values) == min(values) for values in groups.values()]),
            "distinct_responses": _mean([len(set(texts)) / len(texts) for texts in prompts.values()]),
            "top_response_share": _mean([Counter(texts).most_common(1)[0][1] / len(texts)
                                         for texts in prompts.values()]),
            # Across prompts: a verifier sure of each answer has a top share of 1 per prompt, one that says "yes" to
            # everything has it over the step. Per turn, the highest: a collapsed verdict turn beside varied workings
            # would be diluted over both (docs/ARCHITECTURE.md, "Dagster").
            "top_answer_share": max((_top_share(texts) for texts in _by_turn(sampled).values()), default=None),
            "top_answer_reward": _top_answer_reward(sampled, earned),
            **_lags(sampled, version - 1),
            "reward_max": max(earned.values(), default=None),
            "token_entropy": -sum(sum(row["logprobs"]) for row in sampled) / tokens if tokens else None,
            "response_length": tokens / len(sampled) if sampled else None,
            "truncated_share": _mean([row["finish_reason"] == "length" for row in sampled]),
            "loss_per_token": loss / trained_tokens if trained_tokens else None,
            "clip_fraction": _token_mean(trained, "clip_fraction"),
            "mismatch_abs_logprob": _token_mean(trained, "mismatch_abs_logprob"),
            **{name: trainer.get(agent, {}).get(name) for name in TRAINER_SIGNALS}, **_group_figures(turns),
            "reward_mean": _mean([value for values in groups.values() for value in values])})
    return pa.Table.from_pylist(rows, schema=pa.schema([pa.field("agent", pa.string()), *HEALTH]))


def collapse_warnings(history: list[dict], settings: HealthConfig) -> list[str]:
    """What the agents' health rows of the last steps (dicts with ``step``, ``agent`` and the signals, any order)
    show collapsing, one message per agent and sign, naming the agent, the steps and the figures: the same answer
    to every prompt (``top_answer_share`` above its threshold for ``settings.steps`` steps in a row, or on average
    above ``window_share`` over the last ``window`` steps while the agent's mean reward did not rise by
    ``window_gain``), told apart by what that answer earns: less than the best reward a turn earned by more than
    ``converged_margin`` is collapse (:data:`COLLAPSING`, the base rate taken and the rest left), within it is
    :data:`ONE_ANSWER_PAID` (right nearly everywhere, or a reward one answer satisfies); or no learning signal
    (``zero_variance_groups`` above its threshold for ``settings.steps`` steps). Empty when too few steps."""
    warnings = []
    for agent in sorted({row["agent"] for row in history}):
        rows = sorted((row for row in history if row["agent"] == agent), key=lambda row: row["step"])
        last = rows[-settings.steps:]
        if len(last) < settings.steps:
            continue
        steps = f"steps {last[0]['step']}-{last[-1]['step']}"
        shares = [row["top_answer_share"] for row in last]
        # Above the threshold alone, not also rising: real shares jitter near 1 (docs/ARCHITECTURE.md, "Dagster")
        if None not in shares and min(shares) > settings.top_answer_share:
            sign, earned = _what_it_earns(last, settings)
            warnings.append(f"{agent} {sign}: the same response is {_figures(shares)} of its responses in one turn "
                            f"over {steps} (health.top_answer_share: {settings.top_answer_share:g}){earned}")
        elif (hovering := _hovering(rows[-settings.window:], settings)) is not None:
            sign, earned = _what_it_earns(rows[-settings.window:], settings)
            warnings.append(f"{agent} {sign}: {hovering}{earned}")
        flat = [row["zero_variance_groups"] for row in last]
        if None not in flat and min(flat) > settings.zero_variance_groups:
            warnings.append(f"{agent} has almost no learning signal: {_figures(flat)} of its GRPO groups have equal "
                            f"rewards over {steps} (health.zero_variance_groups: {settings.zero_variance_groups:g})")
    return warnings


def _what_it_earns(rows: list[dict], settings: HealthConfig) -> tuple[str, str]:
    """The sign of one answer to everything over ``rows``, and the warning's end: what the turns that gave it earned
    on average (the answer's base rate) against the best reward a turn earned. More than ``converged_margin`` short
    of it: :data:`COLLAPSING` (a checker saying "no" to everything, right where its solver erred, 55-77%). Within it:
    :data:`ONE_ANSWER_PAID` (a reporter saying "none" where its checker said no, right on 99% of its prompts; or a
    checker paid for "yes" whatever it is shown). Rows stored without the figures (older): collapsing, unqualified."""
    earned, best = [row.get("top_answer_reward") for row in rows], [row.get("reward_max") for row in rows]
    if None in earned or None in best:
        return COLLAPSING, ""
    earned_mean, best_mean = sum(earned) / len(earned), sum(best) / len(best)
    sign = COLLAPSING if best_mean - earned_mean > settings.converged_margin else ONE_ANSWER_PAID
    return sign, (f"; that response earns {earned_mean:.2f} where the best turns earned {best_mean:.2f} "
                  f"(health.converged_margin: {settings.converged_margin:g})")


def stopping_collapse(store: ExperienceStore | RecentCommits, config: ExperimentConfig, step: int) -> list[str]:
    """With ``health.on_collapse: stop``, the :data:`COLLAPSING` warnings at ``step`` once its partitions are
    committed and before its update is applied, so that the step's versions can be the launch's last (and be
    checkpointed); empty with ``warn``. The health of ``step`` and of earlier steps whose ``health`` is not committed
    yet comes from their partitions (without trainer figures, which the rules do not read)."""
    settings, run, micro_batches = config.health, config.run, config.pipeline.micro_batches_per_step
    if settings.on_collapse != "stop":
        return []
    agents, history = list(config.agents), []
    for earlier in range(max(0, step - max(settings.steps, settings.window) + 1), step + 1):
        key = MicroBatchKey(run, earlier, 0)
        if earlier < step and store.is_committed("health", key):
            rows = store.read("health", key).to_pylist()
        elif all(store.is_committed("rewards", MicroBatchKey(run, earlier, mb)) for mb in range(micro_batches)):
            rows = step_health(store, run, earlier, dict.fromkeys(agents, earlier + 1), {}, micro_batches).to_pylist()
        else:
            continue
        history += [{"step": earlier, **row} for row in rows]
    return [warning for warning in collapse_warnings(history, settings) if COLLAPSING in warning]


def _hovering(window: list[dict], settings: HealthConfig) -> str | None:
    """Why a top-answer share that hovers around its threshold is collapse: high on average over the window while
    the agent's reward did not rise with it (a learning agent's share may rise as its answers get right); None when
    not, or without a full window of both signals."""
    shares, rewards = [row["top_answer_share"] for row in window], [row.get("reward_mean") for row in window]
    if len(window) < settings.window or None in shares or None in rewards:
        return None
    half = len(window) // 2
    gain = sum(rewards[half:]) / (len(window) - half) - sum(rewards[:half]) / half
    if sum(shares) / len(shares) <= settings.window_share or gain > settings.window_gain:
        return None
    return (f"the same response is on average {sum(shares) / len(shares):.2f} of its responses in one turn over steps "
            f"{window[0]['step']}-{window[-1]['step']} ({_figures(shares)}; health.window_share: "
            f"{settings.window_share:g}) while its mean reward moved {gain:+.3f} (health.window_gain: "
            f"{settings.window_gain:g})")


def started_warnings(previous: list[str], current: list[str]) -> list[str]:
    """The warnings of ``current`` whose agent and sign ("verifier may be collapsing") ``previous``, the step
    before's, did not have: what a log says as a streak starts rather than at each of its steps."""
    ongoing = {warning.split(":", 1)[0] for warning in previous}
    return [warning for warning in current if warning.split(":", 1)[0] not in ongoing]


def stored_collapse(store: ExperienceStore, run: str, step: int, settings: HealthConfig) -> list[str]:
    """:func:`collapse_warnings` at ``step``, from the stored health of the steps up to it."""
    return collapse_warnings(recent_health(store, run, step, max(settings.steps, settings.window)), settings)


def health_state(store: ExperienceStore, run: str, settings: HealthConfig) -> dict[str, list[tuple[str, int]]]:
    """Per agent under a warning at the run's newest stored step: each warning's sign ("may be collapsing", "has
    almost no learning signal") and the step its streak started; agents without one are left out."""
    table = store.read_stage(run, "health") if store.committed_keys(run, "health") else None
    if table is None or not table.num_rows:
        return {}
    history = table.drop_columns([c for c in ("micro_batch",) if c in table.column_names]).to_pylist()
    last, reach = max(row["step"] for row in history), max(settings.steps, settings.window)

    def signs(step: int) -> set[str]:
        rows = [row for row in history if step - reach < row["step"] <= step]
        return {warning.split(":", 1)[0] for warning in collapse_warnings(rows, settings)}

    state: dict[str, list[tuple[str, int]]] = {}
    for sign in sorted(signs(last)):
        since = last
        while since > 0 and sign in signs(since - 1):
            since -= 1
        agent, what = sign.split(" ", 1)
        state.setdefault(agent, []).append((what, since))
    return state


def recent_health(store: ExperienceStore, run: str, step: int, steps: int) -> list[dict]:
    """The health rows of the ``steps`` steps up to ``step`` that the store holds, with their ``step``."""
    keys = [MicroBatchKey(run, s, 0) for s in range(max(0, step - steps + 1), step + 1)]
    return [{"step": key.step, **row} for key in keys if store.is_committed("health", key)
            for row in store.read("health", key).to_pylist()]


def groups_note(signals: dict[str, dict[str, float | None]]) -> str:
    """What a step's log line adds about its groups (from :func:`signals_by_agent`, the most any agent saw): the
    groups short of n finished episodes and the episodes over-sampling dropped; empty when neither happened."""
    most = {name: max((int(by_agent.get(name) or 0) for by_agent in signals.values()), default=0)
            for name in ("short_groups", "shortfall", "dropped_episodes")}
    parts = [f"over-sampling dropped {_count(most['dropped_episodes'], 'episode')}"] if most["dropped_episodes"] else []
    if most["short_groups"]:
        parts.append(f"{_count(most['short_groups'], 'group')} short of n by {_count(most['shortfall'], 'episode')}")
    return "; " + ", ".join(parts) if parts else ""


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _group_figures(turns: list[dict]) -> dict[str, int | None]:
    """Of the groups ``turns`` are in: those short of n finished episodes, the episodes they lack, and the episodes
    over-sampling dropped (each row carries its group's figures); None for rows stored without them."""
    groups = {row["group_id"]: (row["group_shortfall"], row["group_dropped"]) for row in turns
              if row.get("group_shortfall") is not None}
    if not groups:
        return {"short_groups": None, "shortfall": None, "dropped_episodes": None}
    return {"short_groups": sum(short > 0 for short, _ in groups.values()),
            "shortfall": sum(short for short, _ in groups.values()),
            "dropped_episodes": sum(dropped for _, dropped in groups.values())}


def _by_turn(rows: list[dict]) -> dict[int, list[str]]:
    """Each turn's responses, for the turns asked more than one prompt: a turn that answers one prompt throughout (a
    game's first position, the same in every episode) shows a sure answer, not one answer to everything."""
    turns, prompts = defaultdict(list), defaultdict(set)
    for row in rows:
        turns[row["turn"]].append(row["response_text"])
        prompts[row["turn"]].add(row.get("prompt_text"))
    return {turn: texts for turn, texts in turns.items() if len(prompts[turn]) > 1 or None in prompts[turn]}


def _top_share(texts: list[str]) -> float:
    return Counter(texts).most_common(1)[0][1] / len(texts)


def _lags(turns: list[dict], step: int) -> dict[str, float | None]:
    """How far the agent's turns of ``step`` lagged it (step - the version that sampled them): the largest lag, and
    the share of turns sampled at an older version; None for rows stored without their version."""
    lags = [step - row["policy_version"] for row in turns if row.get("policy_version") is not None]
    return {"staleness_max": max(lags, default=None), "stale_share": _mean([lag > 0 for lag in lags])}


def _top_answer_reward(turns: list[dict], earned: dict[str, float]) -> float | None:
    """The mean reward of the turns that gave the most frequent response, in the turn where it is most frequent:
    what that answer alone earns on these prompts (None: no turn, or rewards stored without ``sample_id``)."""
    by_turn = _by_turn(turns)
    if not by_turn or not earned:
        return None
    turn = max(by_turn, key=lambda index: _top_share(by_turn[index]))
    answer = Counter(by_turn[turn]).most_common(1)[0][0]
    return _mean([earned[row["sample_id"]] for row in turns if row["turn"] == turn and row["response_text"] == answer
                  and row.get("sample_id") in earned])


def _figures(values: list[float]) -> str:
    return ", ".join(f"{value:.2f}" for value in values)


def signals_by_agent(table: pa.Table) -> dict[str, dict[str, float | None]]:
    """A health table as each agent's signals (:data:`HEALTH_SIGNALS`), as events and metadata carry them."""
    return {row.pop("agent"): row for row in table.select(["agent", *HEALTH_SIGNALS]).to_pylist()}


def _token_mean(updates: list[dict], column: str) -> float | None:
    """A micro-batch statistic over the step, each micro-batch weighted by its tokens."""
    tokens = sum(row["tokens"] for row in updates)
    return sum((row[column] or 0.0) * row["tokens"] for row in updates) / tokens if tokens else None


def _mean(values: list) -> float | None:
    return sum(values) / len(values) if values else None

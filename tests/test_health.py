"""Training-health signals by hand (stages/health.py): a step's rows in, each agent's figures out; collapse read
from the stored signals of the last steps, as the run's warnings and the ``health`` asset's check report it."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from marl_pipeline.config import HealthConfig
from marl_pipeline.stages.health import (
    COLLAPSING,
    ONE_ANSWER_PAID,
    PERF_SIGNALS,
    collapse_warnings,
    groups_note,
    health_table,
    recent_health,
    signals_by_agent,
    started_warnings,
)
from marl_pipeline.store import ExperienceStore, MicroBatchKey


def _turn(agent: str, group: str, text: str, logprobs: list[float], finish: str = "stop", turn: int = 0) -> dict:
    return {"agent": agent, "group_id": group, "turn": turn, "response_text": text,
            "response_ids": list(range(len(logprobs))), "logprobs": logprobs, "finish_reason": finish}


def test_signals_by_hand() -> None:
    rollouts = [
        # solver, prompt g1: "4" twice and "5" once; prompt g2: "7" twice (one cut at the token limit)
        _turn("solver", "g1", "4", [-1.0]), _turn("solver", "g1", "4", [-1.0]),
        _turn("solver", "g1", "5", [-2.0, -2.0]),
        _turn("solver", "g2", "7", [-0.5]), _turn("solver", "g2", "7", [-0.5], finish="length"),
        # verifier: "yes" to everything
        _turn("verifier", "g1", "yes", [-0.1]), _turn("verifier", "g1", "yes", [-0.1]),
    ]
    rewards = [{"agent": "solver", "group_id": "g1", "reward": r} for r in (1.0, 1.0, 0.0)]
    rewards += [{"agent": "solver", "group_id": "g2", "reward": r} for r in (1.0, 1.0)]
    rewards += [{"agent": "verifier", "group_id": "g1", "reward": r} for r in (0.5, 0.5)]
    updates = [{"agent": "solver", "tokens": 4, "loss_sum": 2.0, "clip_fraction": 0.5, "mismatch_abs_logprob": 0.1},
               {"agent": "solver", "tokens": 2, "loss_sum": 1.0, "clip_fraction": 0.0, "mismatch_abs_logprob": 0.4}]
    trained = {"solver": {"grad_norm": 2.5, "trainer_tokens_per_s": 1200.0, "mfu": 0.25}}
    table = health_table(rollouts, rewards, updates, {"solver": 3, "verifier": 3}, trained)
    solver, verifier = table.to_pylist()
    assert solver["agent"] == "solver" and solver["policy_version"] == 3 and solver["groups"] == 2
    assert solver["zero_variance_groups"] == 0.5  # g2's rewards are all 1
    assert solver["distinct_responses"] == pytest.approx((2 / 3 + 1 / 2) / 2)
    assert solver["top_response_share"] == pytest.approx((2 / 3 + 1) / 2)
    assert solver["token_entropy"] == pytest.approx((1 + 1 + 4 + 0.5 + 0.5) / 6)
    assert solver["response_length"] == pytest.approx(6 / 5)
    assert solver["truncated_share"] == pytest.approx(1 / 5)
    assert solver["loss_per_token"] == pytest.approx(3 / 6)
    assert solver["clip_fraction"] == pytest.approx((0.5 * 4) / 6)
    assert solver["mismatch_abs_logprob"] == pytest.approx((0.1 * 4 + 0.4 * 2) / 6)
    assert solver["grad_norm"] == 2.5 and solver["trainer_tokens_per_s"] == 1200.0 and solver["mfu"] == 0.25
    # The verifier collapsed on "yes": one answer per prompt, no reward variance; it did not train this step.
    assert verifier["top_response_share"] == 1.0 and verifier["distinct_responses"] == 0.5
    assert verifier["top_answer_share"] == 1.0 and solver["top_answer_share"] == pytest.approx(2 / 5)
    assert verifier["zero_variance_groups"] == 1.0
    assert verifier["loss_per_token"] is None and verifier["clip_fraction"] is None
    assert verifier["grad_norm"] is None and verifier["trainer_tokens_per_s"] is None and verifier["mfu"] is None


def test_a_collapsed_turn_shows_beside_an_agents_varied_one() -> None:
    """SmolLM2's verifier works the sum out, then gives its verdict: when every verdict is "No", its workings still
    differ, and the share over both turns would be one half (as measured on the benchmark's seed 1)."""
    rollouts = [row for group in ("g1", "g2") for k in range(4) for row in (
        _turn("verifier", group, f"{group}: {k} + 10 is {k + 10}.", [-1.0], turn=1),
        _turn("verifier", group, "No", [-0.1], turn=2))]
    rewards = [{"agent": "verifier", "group_id": group, "reward": float(k % 2)} for group in ("g1", "g2")
               for k in range(4)]
    (verifier,) = health_table(rollouts, rewards, [], {"verifier": 1}, {}).to_pylist()
    assert verifier["top_answer_share"] == 1.0
    assert verifier["top_response_share"] == pytest.approx((1 / 4 + 1) / 2)  # per prompt and turn, averaged


def _step(step: int, yes_share: float, rewarded: bool = True, prompts: int = 20) -> pa.Table:
    """One step of a solver and a verifier, 4 samples per prompt. The verifier answers every sample of a prompt
    alike (sure of each answer), "yes" to the first ``yes_share`` of the prompts; without ``rewarded`` every group's
    rewards are equal."""
    rollouts, rewards = [], []
    for prompt in range(prompts):
        group = f"s{step}-g{prompt}"
        for sample in range(4):
            answer = "yes" if prompt < yes_share * prompts else "no"
            rollouts += [_turn("solver", group, str(prompt + sample % 2), [-1.0]), _turn("verifier", group, answer,
                                                                                        [-0.1])]
            rewards += [{"agent": agent, "group_id": group, "reward": float(sample % 2) if rewarded else 1.0}
                        for agent in ("solver", "verifier")]
    return health_table(rollouts, rewards, [], {"solver": step + 1, "verifier": step + 1}, {})


def _stored(tmp_path: Path, run: str, steps: list[pa.Table]) -> ExperienceStore:
    store = ExperienceStore(tmp_path / "store")
    for step, table in enumerate(steps):
        store.commit("health", MicroBatchKey(run, step, 0), table)
    return store


def test_an_agent_answering_yes_to_everything_is_caught_from_the_stored_signals_and_a_sure_one_is_not(
        tmp_path: Path) -> None:
    settings = HealthConfig()
    drifting = _stored(tmp_path / "drifting", "drift", [_step(s, share) for s, share in
                                                         enumerate([0.6, 0.8, 0.95, 0.95, 1.0])])
    sure = _stored(tmp_path / "sure", "sure", [_step(s, share) for s, share in enumerate([0.5, 0.55, 0.5, 0.6, 0.55])])
    # Sure of each answer in both runs: one answer per prompt, which the per-prompt share cannot tell apart.
    verifier = [row for row in recent_health(sure, "sure", 4, 5) if row["agent"] == "verifier"]
    assert {row["top_response_share"] for row in verifier} == {1.0}
    assert collapse_warnings(recent_health(sure, "sure", 4, settings.steps), settings) == []
    assert collapse_warnings(recent_health(drifting, "drift", 3, settings.steps), settings) == []  # 0.8: not yet
    (warning,) = collapse_warnings(recent_health(drifting, "drift", 4, settings.steps), settings)
    assert warning.startswith("verifier may be collapsing") and "0.95, 0.95, 1.00" in warning
    assert "steps 2-4" in warning and "health.top_answer_share: 0.9" in warning
    recovering = _stored(tmp_path / "recovering", "recovering", [_step(s, share) for s, share in
                                                                 enumerate([1.0, 0.95, 0.85])])
    assert collapse_warnings(recent_health(recovering, "recovering", 2, 3), settings) == []  # under 0.9 at the end
    lenient = HealthConfig(top_answer_share=0.97, steps=2)
    assert collapse_warnings(recent_health(drifting, "drift", 4, 2), lenient) == []  # settings are thresholds
    flat = _stored(tmp_path / "flat", "flat", [_step(s, 0.5, rewarded=s > 0) for s in range(2)]
                   + [_step(s, 0.5, rewarded=False) for s in range(2, 5)])
    warnings = collapse_warnings(recent_health(flat, "flat", 4, 3), settings)
    assert sorted(w.split(" ")[0] for w in warnings) == ["solver", "verifier"]
    assert all("almost no learning signal" in w and "1.00, 1.00, 1.00" in w for w in warnings)


def test_a_share_hovering_around_its_threshold_is_caught_over_a_window_unless_the_reward_rises() -> None:
    settings = HealthConfig()  # 0.9 three steps in a row, or a mean above 0.8 over 8 steps without a reward gain
    hovering = [0.83, 0.75, 0.81, 0.88, 0.96, 0.91, 0.79, 0.90]  # never three steps in a row above 0.9

    def history(shares: list[float], rewards: list[float | None]) -> list[dict]:
        return [{"step": s, "agent": "checker", "top_answer_share": share, "zero_variance_groups": 0.2,
                 "reward_mean": reward} for s, (share, reward) in enumerate(zip(shares, rewards))]

    flat = [0.52, 0.50, 0.49, 0.51, 0.50, 0.52, 0.50, 0.49]
    (warning,) = collapse_warnings(history(hovering, flat), settings)
    assert warning.startswith("checker may be collapsing: the same response is on average 0.85")
    assert "steps 0-7" in warning and "health.window_share: 0.8" in warning and "moved -0.003" in warning
    learning = [0.40, 0.45, 0.50, 0.55, 0.62, 0.68, 0.74, 0.80]  # its share rises as its answers get right
    assert collapse_warnings(history(hovering, learning), settings) == []
    assert collapse_warnings(history(hovering[1:], flat[1:]), settings) == []  # less than a full window
    assert collapse_warnings(history(hovering, [None] * 8), settings) == []  # stored before the reward was
    varied = [0.6, 0.7, 0.65, 0.8, 0.75, 0.7, 0.72, 0.68]  # a verifier at 0.6-0.8: its mean is under 0.8
    assert collapse_warnings(history(varied, flat), settings) == []
    assert collapse_warnings(history(hovering, flat), HealthConfig(window_share=0.9)) == []  # settings are thresholds


def test_the_health_collapse_check_fails_with_the_agent_and_passes_before(tmp_path: Path,
                                                                          demo_config_data: dict) -> None:
    import dagster as dg
    import yaml

    from assets.health import health, no_collapse_in_training
    from assets.partitions import STEPS, step_key
    from resources import ExperienceStoreResource, ExperimentResource

    _stored(tmp_path, "demo", [_step(s, share) for s, share in enumerate([0.6, 0.8, 0.95, 0.95, 1.0])])
    config_path = tmp_path / "experiment.yaml"
    config_path.write_text(yaml.safe_dump({**demo_config_data, "store": str(tmp_path / "store")}))
    experiment = ExperimentResource(config_path=str(config_path))
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions(STEPS.name, [step_key("demo", 2), step_key("demo", 4)])
    verdicts = {}
    for step in (2, 4):
        result = dg.materialize([health, no_collapse_in_training], instance=instance,
                                selection=dg.AssetSelection.checks(no_collapse_in_training),
                                resources={"experiment": experiment,
                                           "store": ExperienceStoreResource(experiment=experiment)},
                                tags={"dagster/partition": step_key("demo", step)})
        (evaluation,) = result.get_asset_check_evaluations()
        verdicts[step] = evaluation
    assert verdicts[2].passed and "no agent gives one response" in verdicts[2].description
    assert not verdicts[4].passed and verdicts[4].severity == dg.AssetCheckSeverity.WARN
    assert verdicts[4].description.startswith("verifier may be collapsing")


def test_a_streak_is_logged_as_it_starts_not_at_each_of_its_steps() -> None:
    collapsing = "verifier may be collapsing: the same response is {} of its responses in one turn over steps {}"
    flat = "solver has almost no learning signal: 1.00, 1.00, 1.00 of its GRPO groups have equal rewards over {}"
    step_4 = [collapsing.format("0.95, 0.95, 1.00", "2-4")]
    step_5 = [collapsing.format("0.95, 1.00, 1.00", "3-5"), flat.format("steps 3-5")]
    assert started_warnings([], step_4) == step_4
    assert started_warnings(step_4, step_5) == [step_5[1]]  # the verifier's goes on; the solver's starts
    assert started_warnings(step_5, step_5) == []
    assert started_warnings(step_5, step_4) == []  # the solver's ended
    assert started_warnings([], step_4) == step_4  # and the verifier's, once over, is said again when it recurs


def _as_version_7(store: ExperienceStore, key: MicroBatchKey) -> None:
    """Rewrite a committed local health partition as schema 7 wrote it: no trainer throughput columns."""
    partition = Path(store.partition_path("health", key))
    for name in store.manifest("health", key).files.values():
        table = pq.ParquetFile(partition / name).read().drop_columns(list(PERF_SIGNALS))  # raises if absent
        pq.write_table(table.replace_schema_metadata({b"marl_pipeline.schema_version": b"7"}), partition / name)
    record = json.loads((partition / "_manifest.json").read_text())
    (partition / "_manifest.json").write_text(json.dumps({**record, "schema_version": 7}))


def test_health_stored_before_the_trainer_throughput_reads_with_it_null(tmp_path: Path, capsys) -> None:
    """A run stored before schema 8 keeps its health readable: collapse is read from it, ``marl inspect`` shows it,
    and the new columns come back null. The inspect table leaves the throughput out (it is wide already)."""
    from assets.cli.output import console
    from assets.cli.tables import print_health_table

    store = _stored(tmp_path, "old", [_step(s, share) for s, share in enumerate([0.95, 0.95, 1.0])])
    trained = {"solver": {"grad_norm": 1.5, "trainer_tokens_per_s": 900.0, "mfu": 0.125}}
    new = health_table([], [], [], {"solver": 4}, trained)
    store.commit("health", MicroBatchKey("old", 3, 0), new)
    for step in range(3):
        _as_version_7(store, MicroBatchKey("old", step, 0))
    rows = recent_health(store, "old", 3, 4)
    assert [row["mfu"] for row in rows if row["agent"] == "solver"] == [None, None, None, 0.125]
    assert {row["trainer_tokens_per_s"] for row in rows if row["step"] < 3} == {None}
    (warning,) = collapse_warnings(recent_health(store, "old", 2, 3), HealthConfig())
    assert warning.startswith("verifier may be collapsing")
    width = console.width
    console.width = 200
    try:
        print_health_table(store, "old", None, None)
    finally:
        console.width = width
    shown = capsys.readouterr().out
    assert "training health per step" in shown and "grad norm" in shown
    assert "mfu" not in shown and "tokens" not in shown and "900" not in shown


def test_groups_short_of_n_and_dropped_episodes_by_hand(tmp_path: Path, capsys) -> None:
    """Each row carries its group's shortfall and dropped episodes (over-sampling): the health sums them over the
    agent's groups, leaves the dropped turns out of the other signals, and the log line and ``marl inspect`` show
    them."""
    from assets.cli.output import console
    from assets.cli.tables import print_health_table

    def row(agent: str, group: str, text: str, shortfall: int, dropped: int, status: str = "ok") -> dict:
        return {**_turn(agent, group, text, [-1.0]), "status": status, "group_shortfall": shortfall,
                "group_dropped": dropped}

    rollouts = [row("solver", "g1", "4", 0, 2), row("solver", "g1", "4", 0, 2),
                row("solver", "g1", "5", 0, 2, status="dropped"),  # cut: not in the signals below
                row("solver", "g2", "7", 1, 0), row("solver", "g2", "8", 1, 0, status="timeout"),
                row("verifier", "g1", "yes", 0, 2)]
    rewards = [{"agent": "solver", "group_id": group, "reward": r} for group, r in (("g1", 1.0), ("g1", 0.0),
                                                                                   ("g2", 1.0), ("g2", 0.0))]
    table = health_table(rollouts, rewards, [], {"solver": 1, "verifier": 1}, {})
    solver, verifier = table.to_pylist()
    assert (solver["short_groups"], solver["shortfall"], solver["dropped_episodes"]) == (1, 1, 2)
    assert (verifier["short_groups"], verifier["shortfall"], verifier["dropped_episodes"]) == (0, 0, 2)
    assert solver["distinct_responses"] == pytest.approx((1 / 2 + 1) / 2)  # g1's dropped "5" left out
    assert solver["response_length"] == 1.0 and solver["groups"] == 2
    # Rows stored before the figures existed have none.
    (older,) = health_table([_turn("solver", "g1", "4", [-1.0])], [], [], {"solver": 1}, {}).to_pylist()
    assert older["short_groups"] is older["shortfall"] is older["dropped_episodes"] is None
    assert groups_note(signals_by_agent(table)) == "; over-sampling dropped 2 episodes, 1 group short of n by 1 episode"
    assert groups_note(signals_by_agent(health_table([], [], [], {"solver": 1}, {}))) == ""

    store = _stored(tmp_path, "over", [table])
    width = console.width
    console.width = 80
    try:
        print_health_table(store, "over", None, None)
    finally:
        console.width = width
    shown = capsys.readouterr().out
    assert "…" not in shown and "step 0: over-sampling dropped 2 episodes, 1 group short of n by 1 episode" in shown


def _one_answer_steps(answer: str, right: list[bool], steps: int = 3) -> list[pa.Table]:
    """Steps of a verifier giving ``answer`` to every prompt (one sample each), rewarded 1 where ``right``; each turn
    and its reward carry a ``sample_id``, as stored."""
    tables = []
    for step in range(steps):
        rollouts = [{**_turn("verifier", f"s{step}-g{k}", answer, [-0.1]), "sample_id": f"s{step}-{k}"}
                    for k in range(len(right))]
        rewards = [{"agent": "verifier", "group_id": f"s{step}-g{k}", "sample_id": f"s{step}-{k}",
                    "reward": float(ok)} for k, ok in enumerate(right)]
        tables.append(health_table(rollouts, rewards, [], {"verifier": step + 1}, {}))
    return tables


def test_one_answer_to_everything_is_collapse_where_it_leaves_reward_and_convergence_where_it_is_right(
        tmp_path: Path) -> None:
    """The 3-agent plugin of issue 72: its checker said "no" to everything, right where the solver erred (60% here):
    collapse. Its reporter said "none" to everything, right on 99% of its prompts because the checker said no:
    convergence. A checker paid for "yes" whatever it is shown earns the best reward with one answer too."""
    settings = HealthConfig()
    checker = _one_answer_steps("no", [k < 60 for k in range(100)])
    assert [row["top_answer_reward"] for table in checker for row in table.to_pylist()] == pytest.approx([0.6] * 3)
    assert {row["reward_max"] for table in checker for row in table.to_pylist()} == {1.0}
    (collapse,) = [w for w in collapse_warnings(recent_health(_stored(tmp_path / "c", "c", checker), "c", 2, 3),
                                                settings) if "response" in w]
    assert collapse.startswith(f"verifier {COLLAPSING}: the same response is 1.00, 1.00, 1.00")
    assert "that response earns 0.60 where the best turns earned 1.00 (health.converged_margin: 0.05)" in collapse
    reporter = _one_answer_steps("none", [k != 0 for k in range(100)])
    (converged, flat) = collapse_warnings(recent_health(_stored(tmp_path / "r", "r", reporter), "r", 2, 3), settings)
    assert converged.startswith(f"verifier {ONE_ANSWER_PAID}: the same response is 1.00, 1.00, 1.00")
    assert "earns 0.99 where the best turns earned 1.00" in converged and COLLAPSING not in converged
    assert "almost no learning signal" in flat  # every group of one sample: true, and only a warning
    (paid,) = [w for w in collapse_warnings(recent_health(_stored(tmp_path / "p", "p", _one_answer_steps(
        "yes", [True] * 100)), "p", 2, 3), settings) if "response" in w]
    assert paid.startswith(f"verifier {ONE_ANSWER_PAID}")
    # the margin is a setting: at 0.5 the checker's 0.4 untaken is convergence too
    assert all(COLLAPSING not in w for w in collapse_warnings(
        recent_health(_stored(tmp_path / "c2", "c", checker), "c", 2, 3), HealthConfig(converged_margin=0.5)))


def test_a_stopping_launch_reads_collapse_before_the_steps_update_from_its_partitions(
        tmp_path: Path, demo_config_data: dict) -> None:
    """``health.on_collapse: stop`` decides at the train stage, before the step's update: the step's health comes
    from its committed partitions (its own ``health`` is committed only after the update), the steps before from the
    store, and only collapse stops, not one answer that is paid for."""
    from marl_pipeline.config import parse_config
    from marl_pipeline.stages.health import stopping_collapse

    store = ExperienceStore(tmp_path / "store")
    checker = _one_answer_steps("no", [k < 6 for k in range(10)])
    for step, table in enumerate(checker[:2]):
        store.commit("health", MicroBatchKey("demo", step, 0), table)
    key = MicroBatchKey("demo", 2, 0)  # step 2: its partitions, not its health
    rollouts = pa.Table.from_pylist([{**_turn("verifier", f"s2-g{k}", "no", [-0.1]), "sample_id": f"s2-{k}"}
                                     for k in range(10)])
    rewards = pa.Table.from_pylist([{"agent": "verifier", "group_id": f"s2-g{k}", "sample_id": f"s2-{k}",
                                     "reward": float(k < 6)} for k in range(10)])

    class Partitions:  # what the orchestrator's RecentCommits answers for step 2 (the rest: the store)
        def is_committed(self, stage: str, at: MicroBatchKey) -> bool:
            return (at == key and stage != "health") or store.is_committed(stage, at)

        def read(self, stage: str, at: MicroBatchKey, columns: list[str] | None = None) -> pa.Table:
            if at != key:
                return store.read(stage, at, columns=columns)
            table = {"rollouts": rollouts, "rewards": rewards}.get(stage)
            if table is None:  # policy_updates: none yet
                return pa.Table.from_pylist([], schema=pa.schema([(name, pa.float64()) for name in columns]))
            return table.select([name for name in columns if name in table.column_names])

    data = {**demo_config_data, "store": str(tmp_path / "store"), "pipeline": {
        **demo_config_data["pipeline"], "micro_batches_per_step": 1}}
    stop = parse_config({**data, "health": {"on_collapse": "stop"}})
    (found,) = stopping_collapse(Partitions(), stop, 2)
    assert found.startswith(f"verifier {COLLAPSING}") and "steps 0-2" in found
    assert stopping_collapse(Partitions(), stop, 1) == []  # two steps: not yet a streak
    assert stopping_collapse(Partitions(), parse_config(data), 2) == []  # warn: never stops


def test_each_agents_lag_behind_the_step_by_hand() -> None:
    """Step 4 (version 5 made): the solver sampled at versions 4, 4 and 3 (lags 0, 0, 1), the verifier at 4 only."""
    rollouts = [{**_turn("solver", "g1", "4", [-1.0]), "policy_version": v} for v in (4, 4, 3)]
    rollouts += [{**_turn("verifier", "g1", "yes", [-1.0]), "policy_version": 4}]
    solver, verifier = health_table(rollouts, [], [], {"solver": 5, "verifier": 5}, {}).to_pylist()
    assert (solver["staleness_max"], solver["stale_share"]) == (1, pytest.approx(1 / 3))
    assert (verifier["staleness_max"], verifier["stale_share"]) == (0, 0.0)
    (older,) = health_table([_turn("solver", "g1", "4", [-1.0])], [], [], {"solver": 1}, {}).to_pylist()
    assert older["staleness_max"] is None and older["stale_share"] is None  # stored without the version


def test_one_answer_to_one_prompt_is_not_one_answer_to_everything() -> None:
    """A game's first position is the same in every episode: the same opening there is a sure move, not a collapse;
    the same reply to every position of the second turn is."""
    opening = [{**_turn("player_0", f"g{i}", "[4]", [-0.1], turn=0), "prompt_text": "empty board"} for i in range(4)]
    (sure,) = health_table(opening, [], [], {"player_0": 1}, {}).to_pylist()
    assert sure["top_answer_share"] is None
    later = [{**_turn("player_0", f"g{i}", "[4]", [-0.1], turn=2), "prompt_text": f"board {i}"} for i in range(4)]
    (collapsed,) = health_table(opening + later, [], [], {"player_0": 1}, {}).to_pylist()
    assert collapsed["top_answer_share"] == 1.0

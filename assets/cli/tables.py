"""The tables ``marl train`` prints at its end and ``marl inspect`` prints of a stored run: reward per step, held-out
evaluation per version, training health per step."""

from __future__ import annotations

from rich.table import Table

from assets.cli.output import console


def print_reward_table(store, run: str) -> None:
    from marl_pipeline.store.summaries import reward_table

    rewards = store.read_stage(run, "rewards", columns=["step", "agent", "reward"])
    by_step = reward_table(rewards)
    agents = sorted({agent for row in by_step.values() for agent in row})
    table = Table(title=f"mean reward per step, run {run}")
    table.add_column("step", justify="right")
    for agent in agents:
        table.add_column(agent, justify="right")
    table.add_column("mean", justify="right", style="bold")
    for step, row in by_step.items():
        values = [row.get(agent, float("nan")) for agent in agents]
        table.add_row(str(step), *(f"{v:.3f}" for v in values), f"{sum(values) / len(values):.3f}")
    console.print(table)



HEALTH_STEPS_SHOWN = 10
HEALTH_HEADERS = {"zero_variance_groups": "zero-var groups", "distinct_responses": "distinct",
                  "top_response_share": "top share", "top_answer_share": "top overall", "token_entropy": "entropy",
                  "response_length": "length", "truncated_share": "cut", "loss_per_token": "loss/token",
                  "clip_fraction": "clipped", "mismatch_abs_logprob": "mismatch", "grad_norm": "grad norm",
                  "short_groups": "short groups", "shortfall": "shortfall", "dropped_episodes": "dropped",
                  "reward_mean": "reward", "top_answer_reward": "top earns", "reward_max": "best reward",
                  "staleness_max": "max lag", "stale_share": "stale"}
HEALTH_NARROW = {"top_answer_share": "top", "zero_variance_groups": "zero-var", "token_entropy": "entropy",
                 "response_length": "length", "clip_fraction": "clip", "grad_norm": "grad norm"}
"""The signals an 80-column terminal shows (the collapse rules' two first): ``--wide`` shows every one, ``--format
json`` or ``csv`` gives the whole table to scripts."""


def health_rows(store, run: str, step: int | None, agent: str | None) -> tuple[list[dict], int]:
    """The ``health`` rows of the newest steps (or ``step``), each with its run and step, and how many steps."""
    from marl_pipeline.store import MicroBatchKey

    steps = sorted({key.step for key in store.committed_keys(run, "health")})
    steps = [s for s in steps if s == step] if step is not None else steps[-HEALTH_STEPS_SHOWN:]
    rows = [{"run": run, "step": s, **row} for s in steps
            for row in store.read("health", MicroBatchKey(run, s, 0)).to_pylist()
            if agent is None or row["agent"] == agent]
    return rows, len(steps)


def print_health_table(store, run: str, step: int | None, agent: str | None, wide: bool = False) -> None:
    """Each agent's training-health signals per step (the ``health`` dataset): the newest steps, or ``step``; the
    signals that matter (:data:`HEALTH_NARROW`), or with ``wide`` every one but the trainer's throughput."""
    from marl_pipeline.stages.health import HEALTH_SIGNALS, PERF_SIGNALS, groups_note

    rows, steps = health_rows(store, run, step, agent)
    if not rows:
        return
    headers = ({name: HEALTH_HEADERS[name] for name in HEALTH_SIGNALS if name not in PERF_SIGNALS} if wide
               else HEALTH_NARROW)
    table = Table(title=f"training health per step, run {run}" + (f", the last {steps}" if step is None else "")
                  + ("" if wide else " (--wide: every signal)"))
    table.add_column("step", justify="right")
    table.add_column("agent")
    for header in headers.values():
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(str(row["step"]), row["agent"],
                      *("-" if row[name] is None else f"{row[name]:.3g}" for name in headers))
    console.print(table)
    if not wide:  # the groups' figures, under the table, where a step has any (--wide: in it)
        for step in sorted({row["step"] for row in rows}):
            if note := groups_note({row["agent"]: row for row in rows if row["step"] == step}):
                console.print(f"step {step}: {note[2:]}")



def print_evaluation_table(store, run: str) -> None:
    """Each agent's held-out headline metric and top-answer share per evaluated version (if any were)."""
    from marl_pipeline.run.evaluations import evaluation_history
    from marl_pipeline.stages.evaluation import headline_metric

    history = evaluation_history(store, run)
    if not history:
        return
    agents = sorted({agent for by_agent in history.values() for agent in by_agent})
    table = Table(title=f"held-out evaluation per policy version, run {run} (greedy; top = share of the most "
                        f"frequent answer)")
    table.add_column("version", justify="right")
    for agent in agents:
        name = headline_metric(next(m[agent] for m in history.values() if agent in m))[0]
        table.add_column(f"{agent} {name}", justify="right")
        table.add_column(f"{agent} top", justify="right")
    for version, by_agent in history.items():
        cells = []
        for agent in agents:
            if (metrics := by_agent.get(agent)) is None:
                cells += ["-", "-"]
            else:
                cells += [f"{headline_metric(metrics)[1]:.3f}", f"{metrics['top_answer_share']:.2f}"]
        table.add_row(str(version), *cells)
    console.print(table)


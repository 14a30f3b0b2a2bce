"""The run's plots for the Dagster UI: matplotlib figures rendered to PNG and inlined into Markdown metadata.

Dagster's UI renders a Markdown metadata value, and a ``data:`` PNG inside it shows as an image; nothing is
written to disk or served. Markdown of 1,000 characters or more (any PNG) is behind a "[Show Markdown]" link
that opens it in a dialog, so a run's plots go into one value: one click shows them all. Every plot the project
draws is here (the engine computes the figures, this module draws them): reward per agent per step, staleness per
step, held-out evaluation per version, stage activity over time, the planner's predicted busy shares.
"""

from __future__ import annotations

import base64
import io

import dagster as dg


def images_markdown(images: dict[str, bytes]) -> dg.MarkdownMetadataValue:
    """PNGs (alt text -> bytes) as one Markdown metadata value, an image a paragraph, which the UI shows as the
    images themselves."""
    return dg.MetadataValue.md("\n\n".join(f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode()})"
                                            for alt, png in images.items()))


def reward_per_step_png(by_step: dict[int, dict[str, float]], title: str) -> bytes:
    """Each agent's mean reward per step (``summaries.reward_table``'s shape: step -> agent -> mean)."""
    figure, axis = _figure()
    agents = sorted({agent for row in by_step.values() for agent in row})
    for agent in agents:
        points = [(step, row[agent]) for step, row in by_step.items() if agent in row]
        axis.plot([s for s, _ in points], [r for _, r in points], "-o", markersize=3, label=agent)
    return _png(figure, axis, "mean reward", title)


def staleness_png(by_step: dict[int, dict[int, int]], title: str) -> bytes:
    """Turns sampled per step, stacked by staleness (step - policy version): where the pipeline ran ahead."""
    figure, axis = _figure()
    steps = sorted(by_step)
    bottom = [0] * len(steps)
    for staleness in sorted({s for row in by_step.values() for s in row}):
        counts = [by_step[step].get(staleness, 0) for step in steps]
        axis.bar(steps, counts, bottom=bottom, label=f"staleness {staleness}", color=f"C{staleness % 10}")
        bottom = [b + c for b, c in zip(bottom, counts)]
    return _png(figure, axis, "turns", title)


def evaluation_png(history: dict[int, dict[str, dict[str, float]]], title: str = "held-out evaluation") -> bytes:
    """Each agent's headline metric (solid) and top-answer share (dotted) across policy versions (``history``:
    version -> agent -> metrics, ``run.evaluations.evaluation_history``)."""
    from marl_pipeline.stages.evaluation import headline_metric

    figure, axis = _figure((7, 3.5))
    agents = sorted({agent for by_agent in history.values() for agent in by_agent})
    versions = sorted(history)
    for index, agent in enumerate(agents):
        color = f"C{index}"
        points = [(v, history[v][agent]) for v in versions if agent in history[v]]
        name = headline_metric(points[0][1])[0] if points else "metric"
        axis.plot([v for v, _ in points], [headline_metric(m)[1] for _, m in points], "-o", color=color,
                  label=f"{agent} {name}")
        axis.plot([v for v, _ in points], [m["top_answer_share"] for _, m in points], ":", color=color,
                  label=f"{agent} top-answer share")
    axis.set_ylim(0, 1.02)
    axis.legend(fontsize=7, loc="lower right")
    return _png(figure, axis, "", title, xlabel="policy version")


def activity_png(spans: list, started: float, title: str = "stage activity") -> bytes:
    """A Gantt chart of stage work over time (one row per stage, one bar per micro-batch; ``spans``:
    ``run.pipeline_metrics.Span``)."""
    from marl_pipeline.run.pipeline_metrics import STAGE_ORDER

    stages = [stage for stage in STAGE_ORDER if any(s.stage == stage for s in spans)]
    figure, axis = _figure((10, 0.6 * len(stages) + 1.2))
    for row, stage in enumerate(stages):
        for span in (s for s in spans if s.stage == stage):
            axis.broken_barh([(span.started - started, max(span.ended - span.started, 1e-3))], (row - 0.4, 0.8),
                             facecolors=f"C{span.step % 10}", edgecolors="white", linewidth=0.3)
    axis.set_yticks(range(len(stages)), stages)
    axis.invert_yaxis()
    axis.set_xlabel("seconds since the first step started (colour: step)")
    axis.set_title(title)
    return _save(figure)


def _figure(size: tuple[float, float] = (7, 3.2)):
    import matplotlib

    matplotlib.use("Agg")  # no display: rendered to bytes
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=size, dpi=100)


def _png(figure, axis, ylabel: str, title: str, xlabel: str = "step") -> bytes:
    """Steps (or versions) on the x axis (whole numbers), the labels and title, a legend of what was drawn; as PNG
    bytes."""
    from matplotlib.ticker import MaxNLocator

    axis.set_xlabel(xlabel)
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    if axis.get_legend_handles_labels()[0] and axis.get_legend() is None:
        axis.legend(fontsize=8)
    return _save(figure)


def _save(figure) -> bytes:
    import matplotlib.pyplot as plt

    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()


def busy_png(busy: dict[str, float], title: str = "predicted busy share") -> bytes:
    """Each actor's and stage's share of the simulated time spent computing (``Prediction.busy``), busiest first."""
    names = sorted(busy, key=busy.get)
    figure, axis = _figure((7, 0.25 * len(names) + 1.2))
    axis.barh(names, [busy[name] for name in names], color="C0")
    axis.set_xlim(0, 1)
    axis.tick_params(axis="y", labelsize=7)
    axis.set_xlabel("share of the simulated time computing")
    axis.set_title(title)
    return _save(figure)

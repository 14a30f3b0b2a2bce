"""The run's plots for the Dagster UI: matplotlib figures rendered to PNG and inlined into Markdown metadata.

Dagster's UI renders a Markdown metadata value, and a ``data:`` PNG inside it shows as an image; nothing is
written to disk or served. Markdown of 1,000 characters or more (any PNG) is behind a "[Show Markdown]" link
that opens it in a dialog, so a run's plots go into one value: one click shows them all. This module draws the
two per-run plots the engine does not (reward per agent per step, staleness per step) and wraps any PNG, the
engine's stage-activity and evaluation plots included.
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


def _figure():
    import matplotlib

    matplotlib.use("Agg")  # no display: rendered to bytes
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 3.2), dpi=100)


def _png(figure, axis, ylabel: str, title: str) -> bytes:
    """Steps on the x axis (whole numbers), the labels and title, a legend of what was drawn; as PNG bytes."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    axis.set_xlabel("step")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()

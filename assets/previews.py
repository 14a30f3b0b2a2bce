"""A stage partition's first few episodes as a readable conversation, for the Dagster UI (Markdown metadata).

The ``sample_turns`` table shows columns cut to 80 characters; this shows what the agents said to each other:
every turn in order, the prompt its agent was given (quoted) and its answer, with its policy version, (for
rewards) its reward and advantage, and the environment's reply where it gave one. A prompt that extends the
previous turn's prompt and answer (a chat transcript) shows only what was added.
"""

from __future__ import annotations

import pyarrow as pa

EPISODES = 2
TEXT_CHARS = 600
"""Each prompt, response and reply is cut to this many characters: a preview, not the record."""
PREVIEW_COLUMNS = ["sample_id", "episode", "task_id", "agent", "turn", "policy_version", "prompt_text",
                   "response_text", "observation", "status", "error"]
"""The rollouts columns a preview reads (the stored partition's, for a later stage's preview)."""

_MARKDOWN = str.maketrans({c: "\\" + c for c in "\\`*_{}[]()#+-.!|~"} | {"<": "&lt;", ">": "&gt;", "&": "&amp;"})


def episodes_markdown(rollouts: pa.Table, scores: pa.Table | None = None, episodes: int = EPISODES) -> str:
    """The first ``episodes`` episodes of a micro-batch's ``rollouts`` rows, each turn followed by its reward and
    advantage when ``scores`` (rows of the ``rewards`` stage, joined on ``sample_id``) are given."""
    missing = sorted(set(PREVIEW_COLUMNS) - set(rollouts.column_names))
    if missing:
        raise ValueError(f"an episode preview needs the rollouts columns {missing}")
    by_sample = {}
    if scores is not None:
        by_sample = {row["sample_id"]: row for row in scores.select(
            [c for c in ("sample_id", "reward", "advantage") if c in scores.column_names]).to_pylist()}
    rows = sorted(rollouts.select(PREVIEW_COLUMNS).to_pylist(), key=lambda row: (row["episode"], row["turn"]))
    chosen = sorted({row["episode"] for row in rows})[:episodes]
    parts = []
    for episode in chosen:
        turns = [row for row in rows if row["episode"] == episode]
        parts.append(f"**episode {episode}** (task {_text(turns[0]['task_id'], 80)})")
        previous = ""
        for turn in turns:
            parts.append(_turn(turn, by_sample.get(turn["sample_id"]), previous))
            previous = (turn["prompt_text"] or "") + (turn["response_text"] or "")
    return "\n\n".join(parts) if parts else "*(no episodes in this partition)*"


def _prompt(prompt: str | None, previous: str) -> str:
    """The prompt as a quote: what it adds to ``previous`` (the transcript so far) when it extends it, and its
    end when it is long (where the question is)."""
    prompt = prompt or ""
    extends = bool(previous) and prompt.startswith(previous)
    shown = prompt[len(previous):] if extends else prompt
    return "> " + ("… " if extends or len(shown) > TEXT_CHARS else "") + _text(shown[-TEXT_CHARS:])


def _turn(turn: dict, score: dict | None, previous: str) -> str:
    figures = [f"turn {turn['turn']}", f"policy v{turn['policy_version']}"]
    if score is not None and score.get("reward") is not None:
        figures.append(f"reward {score['reward']:.3f}")
    if score is not None and score.get("advantage") is not None:
        figures.append(f"advantage {score['advantage']:+.3f}")
    lines = [f"**{_text(turn['agent'], 80)}** ({', '.join(figures)}): {_text(turn['response_text'])}"]
    if turn["observation"]:
        lines.append(f"*environment:* {_text(turn['observation'])}")
    if turn["status"] != "ok":
        lines.append(f"*{_text(turn['status'], 80)}:* {_text(turn['error'])}")
    # A Markdown line break between the lines of one turn; a blank line after its prompt's quote.
    return _prompt(turn["prompt_text"], previous) + "\n\n" + "  \n".join(lines)


def _text(value, limit: int = TEXT_CHARS) -> str:
    """Model text shown as written: cut, newlines kept as spaces, Markdown and HTML characters escaped."""
    text = "" if value is None else str(value)
    if len(text) > limit:
        text = text[:limit] + " …"
    return " ".join(text.split()).translate(_MARKDOWN) if text.strip() else "*(empty)*"

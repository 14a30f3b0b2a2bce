"""What the Dagster UI shows of a stored run, without engines: episode previews and the run's plots as metadata."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pyarrow as pa
import pytest

from assets.metadata import run_plots, stage_metadata
from assets.plots import images_markdown
from assets.previews import PREVIEW_COLUMNS, TEXT_CHARS, episodes_markdown
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from tests.stored_run import write_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def store(tmp_path: Path) -> ExperienceStore:
    store = ExperienceStore(tmp_path / "store")
    write_run(store, run="r", steps=3)
    return store


_IMAGE = re.compile(r"!\[([^\]]*)\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)")


def _png(markdown: str) -> bytes:
    found = _IMAGE.fullmatch(markdown)
    assert found, markdown[:100]
    return base64.b64decode(found.group(2))


def _alt(markdown: str) -> str:
    return _IMAGE.fullmatch(markdown).group(1)


def test_rollouts_partition_previews_its_first_episodes_as_a_conversation(store) -> None:
    key = MicroBatchKey("r", 1, 0)
    metadata = stage_metadata("rollouts", "p", 1.0, store.read("rollouts", key))
    text = metadata["episodes"].value
    # write_run: episode e asks "What is e+e?", the solver answers 2e, the verifier says "correct".
    assert text.index("**episode 0**") < text.index("What is 0\\+0?") < text.index("**solver** (turn 0, policy v0)")
    assert text.index("**solver** (turn 0") < text.index("**verifier** (turn 1") < text.index("**episode 1**")
    assert "**episode 2**" not in text  # a preview: the first two episodes only
    assert "reward" not in text  # rollouts carry no reward yet


def test_rewards_partition_preview_shows_each_turns_reward(store) -> None:
    key = MicroBatchKey("r", 1, 0)
    rewards = store.read("rewards", key)
    metadata = stage_metadata("rewards", "p", 1.0, rewards, store.read("rollouts", key, columns=PREVIEW_COLUMNS))
    expected = rewards.filter(pa.compute.equal(rewards.column("episode"), 0)).sort_by("turn").to_pylist()
    shown = re.findall(r"reward (-?\d\.\d{3}), advantage ([+-]\d\.\d{3})", metadata["episodes"].value)
    assert shown[:2] == [(f"{row['reward']:.3f}", f"{row['advantage']:+.3f}") for row in expected]
    # Other stages have no text to show, and a rewards partition without its rollouts shows none.
    assert "episodes" not in stage_metadata("rewards", "p", 1.0, rewards)
    assert "episodes" not in stage_metadata("environment_results", "p", 1.0, store.read("environment_results", key))


def test_model_text_is_shown_as_written_not_as_markdown(store) -> None:
    rollouts = store.read("rollouts", MicroBatchKey("r", 0, 0), columns=PREVIEW_COLUMNS)
    texts = rollouts.column("response_text").to_pylist()
    texts[0] = "**7** <script>x</script> [link](http://a) # not a heading\nsecond line"
    texts[1] = "y" * (TEXT_CHARS + 50)
    text = episodes_markdown(rollouts.set_column(rollouts.column_names.index("response_text"), "response_text",
                                                 pa.array(texts)))
    assert "\\*\\*7\\*\\* &lt;script&gt;x&lt;/script&gt; \\[link\\]\\(http://a\\) \\# not a heading second line" in text
    assert "y" * TEXT_CHARS + " …" in text and "y" * (TEXT_CHARS + 1) not in text


def test_a_preview_names_the_columns_it_lacks(store) -> None:
    rollouts = store.read("rollouts", MicroBatchKey("r", 0, 0), columns=["sample_id", "episode", "agent"])
    with pytest.raises(ValueError, match=r"needs the rollouts columns \['error', 'observation'"):
        episodes_markdown(rollouts)


def test_run_plots_are_pngs_of_the_runs_whole_lineage_in_one_markdown_value(store) -> None:
    plots = run_plots(store, "r")
    # No launch timeline given and no evaluation stored: only the plots the store can make.
    assert set(plots) == {"reward per step", "staleness per step"}
    markdown = images_markdown(plots).value
    images = markdown.split("\n\n")
    assert [_alt(image) for image in images] == ["reward per step", "staleness per step"]
    assert [_png(image) for image in images] == list(plots.values())
    assert all(png.startswith(PNG_MAGIC) for png in plots.values())
    assert run_plots(store, "no_such_run") == {}


def test_each_turn_shows_its_own_prompt_or_what_it_adds_to_the_transcript(store) -> None:
    rollouts = store.read("rollouts", MicroBatchKey("r", 0, 0), columns=PREVIEW_COLUMNS).sort_by(
        [("episode", "ascending"), ("turn", "ascending")]).slice(0, 2)
    # The verifier's prompt extends the solver's (a chat transcript): only what it adds is quoted.
    prompts = ["Q: 1+1?", "Q: 1+1?2\nVerifier: is 2 right?"]
    shown = episodes_markdown(rollouts.set_column(rollouts.column_names.index("prompt_text"), "prompt_text",
                                                  pa.array(prompts)).set_column(
        rollouts.column_names.index("response_text"), "response_text", pa.array(["2", "yes"])))
    assert shown.split("\n\n")[1:] == ["> Q: 1\\+1?", "**solver** (turn 0, policy v0): 2",
                                       "> … Verifier: is 2 right?", "**verifier** (turn 1, policy v0): yes"]

"""A team of two model families (issue 73.2): SmolLM2-135M-Instruct as the solver, the built-in tiny model as the
verifier, each with its own tokenizer, on real Ray, vLLM and torch. Turns pass between agents as text; each agent's
rows hold its own tokenizer's ids; the run continues in a second launch; ``marl export --all-agents`` writes each
agent as its own model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from marl_pipeline.config import parse_config
from marl_pipeline.run.recipe import train
from marl_pipeline.store import ExperienceStore
from tests.conftest import small_config_data
from tests.test_model_sources import needs_smollm2

pytestmark = pytest.mark.launch
SHARES_WARM_ACTORS = True  # its launches take the engines and trainers the module before kept (conftest)


@needs_smollm2
def test_a_team_of_two_model_families_trains_continues_and_exports_each_agent(local_ray, smollm2_dir: Path,
                                                                              demo_config_data: dict,
                                                                              tmp_path: Path) -> None:
    data = small_config_data(demo_config_data, tmp_path / "store", steps=1, micro_batches_per_step=1)
    data["agents"]["solver"] = {"model": str(smollm2_dir), "warmup": {"steps": 0},
                                "engine": {"max_model_len": 128, "gpu_memory_utilization": 0.08},
                                "trainer": {"lr": 1e-5, "chunk_tokens": 512}}
    data["algorithm"] = {"max_new_tokens": 4}
    list(train(parse_config(data)))
    list(train(parse_config(data)))  # a second launch continues the finished run from its stored versions

    store = ExperienceStore(data["store"])
    for agent in ("solver", "verifier"):
        assert store.policy_versions("demo", agent) == [0, 1, 2], agent
    rows = store.read_stage("demo", "rollouts", columns=["agent", "step", "episode", "task", "prompt_text",
                                                         "prompt_ids", "response_text"]).to_pylist()
    assert {row["step"] for row in rows} == {0, 1}
    tokenizers = {"solver": AutoTokenizer.from_pretrained(str(smollm2_dir)),
                  "verifier": AutoTokenizer.from_pretrained(str(store.require_policy("demo", "verifier", 0)))}
    for row in rows:  # each agent's rows: its own tokenizer's ids of its own prompt, never the other's
        own = tokenizers[row["agent"]](row["prompt_text"], add_special_tokens=False)["input_ids"]
        other = tokenizers["verifier" if row["agent"] == "solver" else "solver"](
            row["prompt_text"], add_special_tokens=False)["input_ids"]
        assert row["prompt_ids"] == own != other, row
    solver_text = {(row["step"], row["episode"]): row["response_text"] for row in rows if row["agent"] == "solver"}
    judged = [row for row in rows if row["agent"] == "verifier" and "shown" not in json.loads(row["task"])]
    assert judged  # the verifier read the solver's answer as text, re-tokenized by its own tokenizer
    for row in judged:
        shown = solver_text[(row["step"], row["episode"])].strip().split("\n", 1)[0].strip()
        assert row["prompt_text"].endswith(f"={shown}?"), (row["prompt_text"], shown)

    from typer.testing import CliRunner

    from assets.cli import app

    out = tmp_path / "release"
    result = CliRunner().invoke(app, ["export", str(store.root), "--run", "demo", "--all-agents", "--out", str(out)])
    assert result.exit_code == 0, result.output
    families = {agent: AutoConfig.from_pretrained(str(out / agent)).model_type for agent in ("solver", "verifier")}
    assert families == {"solver": "llama", "verifier": "qwen2"}
    for agent in ("solver", "verifier"):  # each release carries its own tokenizer
        assert AutoTokenizer.from_pretrained(str(out / agent)).vocab_size == tokenizers[agent].vocab_size

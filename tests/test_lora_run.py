"""A LoRA agent beside a fully fine-tuned one in the real pipeline (Ray, two vLLM engines, torch trainers): two
launches end with the parameters of one (AdamW included), versions after 0 hold adapters only, retention keeps the
base, and recomputing a pruned version names it."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from marl_pipeline.config import parse_config
from marl_pipeline.run.recipe import train
from marl_pipeline.stages.recompute import recompute_stage
from marl_pipeline.store import ExperienceStore, MicroBatchKey
from marl_pipeline.store.experience import StoreError
from tests.conftest import small_config_data

pytestmark = pytest.mark.launch
SHARES_WARM_ACTORS = True  # its launches take the engines and trainers the module before kept (conftest)

PARAMETER_TOLERANCE = 1e-6
ADAPTERS, FULL = "adapter_model.safetensors", "model.safetensors"


def _config(demo_config_data: dict, store: Path, steps: int):
    data = small_config_data(demo_config_data, store, steps=steps, micro_batches_per_step=2)
    data["agents"]["solver"]["lora"] = {"rank": 4, "alpha": 8.0}
    return parse_config(data)


def test_a_lora_agent_beside_a_full_one_resumes_to_the_uninterrupted_parameters(local_ray, demo_config_data,
                                                                                tmp_path: Path) -> None:
    one = _config(demo_config_data, tmp_path / "one", 3)
    list(train(one))
    for steps in (2, 1):  # the second launch starts its engines and trainers from version 2: base + stored adapters
        list(train(_config(demo_config_data, tmp_path / "two", steps)))
    two = _config(demo_config_data, tmp_path / "two", 1)
    stores = ExperienceStore(one.store), ExperienceStore(two.store)
    for store in stores:
        assert store.policy_versions("demo", "solver") == [0, 2, 3]  # retention's defaults keep the base, 0
        solver = {p.name for p in store.policy_dir("demo", "solver", 3).iterdir()}
        assert ADAPTERS in solver and FULL not in solver
        assert FULL in {p.name for p in store.policy_dir("demo", "solver", 0).iterdir()}
        assert FULL in {p.name for p in store.policy_dir("demo", "verifier", 3).iterdir()}
    for agent, file in (("solver", ADAPTERS), ("verifier", FULL)):
        straight, resumed = (load_file(store.policy_dir("demo", agent, 3) / file) for store in stores)
        assert straight.keys() == resumed.keys()
        assert max((straight[n] - resumed[n]).abs().max().item() for n in straight) <= PARAMETER_TOLERANCE, agent
    adapters = load_file(stores[0].policy_dir("demo", "solver", 3) / ADAPTERS)
    assert max(t.abs().max().item() for n, t in adapters.items() if "lora_B" in n) > 0

    with pytest.raises(StoreError, match=r"policy version 1 of agent 'solver' in run 'demo' is not stored"):
        recompute_stage("policy_updates", one, stores[0], MicroBatchKey("demo", 1, 0))
    # a kept version's gradient is recomputed on the stored adapters, and equals the stored statistics
    key = MicroBatchKey("demo", 2, 0)
    stored = stores[0].read("policy_updates", key).sort_by("agent").to_pylist()
    recompute_stage("policy_updates", one, stores[0], key)
    again = stores[0].read("policy_updates", key).sort_by("agent").to_pylist()
    for before, after in zip(stored, again, strict=True):
        assert after["agent"] == before["agent"] and after["policy_version"] == before["policy_version"] == 2
        assert after["loss_sum"] == pytest.approx(before["loss_sum"], rel=1e-6, abs=1e-6)  # as tests/test_train_job.py

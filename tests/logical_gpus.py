"""For the probes that check GPU placement on Ray's logical GPUs, in a child process (the suite's shared Ray instance
declares none): a Ray instance of 2 CPUs and 4 logical GPUs, and a store holding ``model`` as run ``r``'s solver,
version 0."""

from __future__ import annotations

import shutil

from marl_pipeline.config import StoreConfig
from marl_pipeline.store import ExperienceStore


def start(model: str, root: str) -> ExperienceStore:
    import ray

    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False)
    store = ExperienceStore(StoreConfig(uri=root))
    staging = store.staging_policy_dir("r", "solver", 0)
    shutil.copytree(model, staging, dirs_exist_ok=True)
    store.commit_policy(staging, "r", "solver", 0)
    return store

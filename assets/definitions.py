"""The one Definitions object of the project (loaded by workspace.yaml and the ``marl`` CLI).

Nothing heavy is imported here: torch, vLLM and Ray load inside the ops and assets that use them.
"""

from __future__ import annotations

import dagster as dg

from assets.checks import STAGE_CHECKS
from assets.evaluations import evaluations, no_collapsed_agent, team_casts
from assets.health import health, no_collapse_in_training
from assets.planning import capacity_plan
from assets.policies import base_policies, policies
from assets.retrain import mark_dead_launches, retrain_on_new_tasks
from assets.stages import STAGE_ASSETS
from assets.train import retrain_schedule, train_job, training_runs
from resources import ExperienceStoreResource, ExperimentResource, RayCluster

# Configured at launch and nested in the other two: run config given for `experiment` (the CLI's, the UI
# launchpad's) reaches the store and Ray resources too, so all three read the same YAML file.
experiment = ExperimentResource.configure_at_launch()

defs = dg.Definitions(
    assets=[base_policies, policies, *STAGE_ASSETS, evaluations, team_casts, health, training_runs, capacity_plan],
    asset_checks=[*STAGE_CHECKS, no_collapsed_agent, no_collapse_in_training],
    jobs=[train_job],
    schedules=[retrain_schedule],
    sensors=[retrain_on_new_tasks, mark_dead_launches],
    resources={
        "experiment": experiment,
        "store": ExperienceStoreResource(experiment=experiment),
        "ray": RayCluster(experiment=experiment, ray_init_options={"include_dashboard": False}),
    },
)

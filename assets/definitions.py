"""The one Definitions object of the project (loaded by workspace.yaml and the ``marl`` CLI).

Nothing heavy is imported here: torch, vLLM and Ray load inside the ops and assets that use them.
"""

from __future__ import annotations

import dagster as dg

from assets.checks import STAGE_CHECKS
from assets.policies import base_policies, policies
from assets.stages import STAGE_ASSETS
from assets.train import retrain_schedule, train_job
from resources import ExperimentResource, RayCluster

defs = dg.Definitions(
    assets=[base_policies, policies, *STAGE_ASSETS],
    asset_checks=STAGE_CHECKS,
    jobs=[train_job],
    schedules=[retrain_schedule],
    resources={
        "experiment": ExperimentResource(),
        "ray": RayCluster(ray_init_options={"include_dashboard": False}),
    },
)

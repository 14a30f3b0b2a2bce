"""Dagster resources: thin adapters over marl_pipeline (Ray, the experiment config, the experience store)."""

from resources.experiment import ExperimentResource
from resources.ray_cluster import SETUP_PREFIX, RayCluster
from resources.store import ExperienceStoreResource

__all__ = ["SETUP_PREFIX", "ExperienceStoreResource", "ExperimentResource", "RayCluster"]

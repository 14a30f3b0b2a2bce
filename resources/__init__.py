"""Dagster resources: thin adapters over marl_pipeline (Ray, the experiment config, the experience store)."""

from resources.experiment import ExperimentResource
from resources.ray_cluster import RayCluster
from resources.store import ExperienceStoreResource

__all__ = ["ExperienceStoreResource", "ExperimentResource", "RayCluster"]

"""Ray's side of a spec (specs.py): the options its actor is started with, and its placement group."""

from __future__ import annotations

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from marl_pipeline.cluster.specs import ActorSpec, GroupSpec


def actor_options(spec: ActorSpec, group: PlacementGroup | None = None) -> dict:
    """The ``.options(...)`` of the actor ``spec`` describes; ``group``: the placement group made from ``spec.group``
    (its bundle ``spec.bundle``)."""
    options = dict(num_cpus=spec.cpus, num_gpus=spec.gpus, resources=dict(spec.resources))
    if spec.env:
        options["runtime_env"] = {"env_vars": dict(spec.env)}
    if group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=spec.bundle, placement_group_capture_child_tasks=spec.capture_children)
    return options


def placement_group(spec: GroupSpec) -> PlacementGroup:
    """The placement group ``spec`` describes (not waited for: its actors wait in it)."""
    return ray.util.placement_group([dict(b) for b in spec.bundles], strategy=spec.strategy)

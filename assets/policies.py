"""Policy assets: ``base_policies`` (version 0 of every agent) and ``policies`` (one materialization per version)."""


import dagster as dg

from assets.partitions import AGENTS
from resources import ExperienceStoreResource, ExperimentResource, RayCluster


def base_policy_metadata(base_policies) -> dict[str, dg.MetadataValue]:
    metadata: dict[str, dg.MetadataValue] = {}
    for policy in base_policies:
        metadata[f"path/{policy.agent}"] = dg.MetadataValue.path(str(policy.path))
        metadata[f"created/{policy.agent}"] = dg.MetadataValue.bool(policy.created)
        if policy.warmup_loss:
            metadata[f"warmup_loss/{policy.agent}"] = dg.MetadataValue.text(
                f"{policy.warmup_loss[0]:.3f} -> {policy.warmup_loss[1]:.3f}")
    return metadata


@dg.asset(group_name="policies", kinds={"torch"})
def base_policies(experiment: ExperimentResource, store: ExperienceStoreResource, ray: RayCluster
                  ) -> dg.MaterializeResult:
    """Version 0 of every agent: the configured model (built-in tiny one by default) after its warm-up, prepared on
    Ray with each agent's trainer resources (the code a launch runs when a version 0 is missing).

    Already committed versions are kept: a run's lineage is never overwritten.
    """
    from marl_pipeline.bootstrap.policies import prepare_base_policies
    from marl_pipeline.environment import build_environment

    config = experiment.load()
    env = build_environment(config.environment.name, config.environment.options)
    return dg.MaterializeResult(metadata=base_policy_metadata(
        prepare_base_policies(config, env, store.open(), on_ray=True)))


# Recorded by the train job after each optimizer step (with lineage to the stage partitions that
# trained it); not materialized on its own.
policies = dg.AssetSpec(
    "policies",
    partitions_def=AGENTS,
    group_name="policies",
    deps=["policy_updates", base_policies],
    description="Each agent's policy: one materialization per policy version, recorded by the train job.",
    kinds={"torch"},
)
